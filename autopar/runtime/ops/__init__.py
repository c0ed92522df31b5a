"""The sharded ops an emitted graph calls, one family per file."""
