"""The training data path between hidden states and the drafter, the same for every source: a store's documents or a
runner's (online: the target run over the JSONL in this process, in vLLM, or at an address), packed into rows,
anchored, batched.

    batches     packing, the epoch schedule, anchor sampling, collate, the DataLoader over a store
    online      OnlineSource (a runner read like a store) and OnlineBatches (the forward one micro-batch ahead)
"""
