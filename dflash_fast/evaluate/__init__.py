"""Real acceptance, measured: our evaluator and vLLM's, their report, the plots, and the quickstart.

    decode       block speculative decoding and greedy decoding with an HF target (cache rollback)
    report       the tally of a decoding run and its JSON report and summary
    benchmarks   the public benchmarks of published tables: read, rendered, decoded turn by turn, one row each
    evaluate     `dflash-fast eval`: drafter + prompts -> report (--engine hf | vllm | both)
    vllm         vLLM serving the target and the export (eval --engine vllm), side by side with ours
    plot         `dflash-fast plot`: training curves, recipe comparisons, tau per benchmark
    quickstart   `dflash-fast quickstart`: the whole pipeline on the embedded target
"""
