"""dflash-fast: train DFlash block drafters on a frozen target's hidden states.

Pipeline (one module a stage):

    JSONL ──extract──▶ store ──batches──▶ drafter(ops) ──loss──▶ trainer ──▶ export ──▶ evaluate
"""

__version__ = "0.1.0"
