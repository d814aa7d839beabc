"""The drafter: one backbone, one module per family, and the four hot ops with their eager twins.

    config      DrafterConfig (built from the target's config), its value rules, the family its options describe
    weights     the drafter's weights read from files, checked; the frozen tensors from the target
    layers      the decoder layer: RMSNorm, RoPE, anchored attention over [ctx ; block], SwiGLU MLP
    conv        DFlash2's dynamic convolution inside the decoder layer (eager twin, kernel switch, module)
    targets     where every slot's teacher lives (targets at p-1) and what each loss kind scores it against
    backbone    DFlashDrafter: the DFlash family, the backbone every family shares, the family interface
    dspark      the DSpark family: Markov bias (vanilla / gated / rnn), confidence head, DSparkDrafter
    dflash2     the DFlash2 family: the candidate selector, its loss, DFlash2Drafter
    families    the one list of families (importing it registers each family's class)
    model       build_drafter, the metrics' sums
    losses      the loss vocabulary and the types the eager twin and the kernel share
    masks       the mask rules the eager twin and the attention kernel share
    eager       the eager twins of the kernels (spec.md in plain torch, the test oracle)
    ops         the switch: each hot op -> eager | triton (dflash_fast.kernels)
"""
