"""Everything about ``compile=``: torch.compile of a bound graph, compiling it in pieces, CUDA graphs, and the
ranks' agreement on what they compiled."""
