"""The hidden-state store on disk (spec.md §2): what a token holds and how it is written and read.

    layer_ids   the layer-id rule (spec.md §1): which ids exist, the default spread, `--layer-ids` parsing
    fp8         fp8 packing of `hidden` / `last` and its per-token scales
    format      file names, dtypes, JSON schemas, Layout (the bytes of a token), the manifest, the shard checks
    reader      HiddenStateStore (memory-mapped, checked on open) and `dflash-fast verify`
    writer      StoreWriter: shards into `.tmp/` renamed when complete, resume, the manifest last
"""
