"""The drafter: one model, its families' heads, and the three hot ops with their eager twins.

    config      DrafterConfig (built from the target's config) and its value rules
    weights     the drafter's weights read from files, checked; the frozen tensors from the target
    layers      the decoder layer: RMSNorm, RoPE, anchored attention over [ctx ; block], SwiGLU MLP
    model       DFlashDrafter (the DFlash family and the backbone every family shares), targets at p-1, metrics
    dspark      the DSpark family's heads: Markov bias (vanilla / gated / rnn) and confidence
    eager       the eager twins of the kernels (spec.md in plain torch, the test oracle)
    ops         the switch: each hot op -> eager | triton (dflash_fast.kernels)
"""
