"""The plan search at scale, on paper: published training configurations, reproduced with published
hardware constants (``autopar/hardware/a100-80gb.json``).

Megatron-LM's GPT runs on DGX A100 clusters (Narayanan et al., "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM", SC'21, arXiv 2104.04473, Table 1): GPT-style models of
51,200 tokens' vocabulary and 2,048-token sequences, tensor-parallel 8 within a node, pipelines across
nodes, micro-batches of one or two sequences, mixed precision. Either the search picks the same tensor x
pipeline shape, or it predicts the published shape (at its best micro-batch count among the search's
candidates) within 10% of its own pick's time. The models are built on the meta device as HF GPT-2 of the
published shapes; nothing is allocated.

BLOOM-176B (BigScience, "BLOOM: A 176B-Parameter Open-Access Multilingual Language Model", arXiv 2211.05100,
section 3.4): 384 A100 80GB GPUs in 48 nodes, tensor-parallel 4, pipeline-parallel 12, data-parallel 8, 2,048
sequences of 2,048 tokens per step in micro-batches of 2, bf16; 70 layers, hidden 14,336, 112 heads,
250,880 tokens' vocabulary (built as GPT-2 of that shape: ALiBi's biases instead of GPT-2's position table
change no matmul). BLOOM shards its optimizer state over data (ZeRO-1); autopar does not, and the published
shape fits 80 GB without it on its fullest rank (the first: the embedding, 6 blocks, 12 micro-batches in
flight, its blocks recomputed one micro-batch at a time).
"""

from __future__ import annotations

import pytest
import torch

from autopar.plan import load_machine, score, search
from passes.analysis.search_plans import candidates

transformers = pytest.importorskip("transformers")

# name: (layers, hidden, heads, vocabulary, GPUs, global batch, published tensor-parallel, pipeline-parallel)
PUBLISHED = {
    "gpt-39.1b": (48, 8192, 64, 51200, 512, 1536, 8, 2),
    "gpt-76.1b": (60, 10240, 80, 51200, 1024, 1792, 8, 4),
    "gpt-145.6b": (80, 12288, 96, 51200, 1536, 2304, 8, 8),
    "bloom-176b": (70, 14336, 112, 250880, 384, 2048, 4, 12),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_configurations(name):
    layers, hidden, heads, vocab, gpus, batch, tp, pp = PUBLISHED[name]
    config = transformers.GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, n_inner=4 * hidden,
                                     vocab_size=vocab, n_positions=2048, use_cache=False)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    inputs = (torch.empty(batch, 2048, dtype=torch.long, device="meta"),)
    machine = load_machine("a100-80gb")
    best = search(model, inputs, gpus, machine, precision="bf16")[0]
    assert best.fits, best
    shape = (best.candidate.row * best.candidate.col * best.candidate.depth, best.candidate.pipeline)
    if shape == (tp, pp):
        return
    rows = batch // (gpus // (tp * pp))  # per data shard; Megatron's micro-batches had one or two of them
    published = [c for c in candidates(gpus, batch, fixed={"row": tp, "col": 1, "depth": 1, "pipeline": pp})
                 if c.microbatches in (rows, rows // 2)]
    scored = [score(model, inputs, c, machine, precision="bf16") for c in published]
    fastest = min((s for s in scored if s.fits), key=lambda s: s.seconds)
    ratio = fastest.seconds / best.seconds
    assert 0.9 <= ratio <= 1.1, (name, best.candidate.describe(), best.seconds, fastest.candidate.describe(),
                                 fastest.seconds)
