"""The frozen target as every stage sees it: loaded, tapped, fed text, prompted, run by vLLM.

    load        the target named, checked, loaded (HF), its head alone, its size, its fingerprint
    norm        rms_norm and the final norm (`last` is its input; spec.md §1-2)
    taps        the tap rule: LayerTaps hooks (layer id l -> output of decoder layer l; `last`)
    text        conversation roles and the text checks every record passes
    records     JSONL training records -> tokenized documents (chat template, assistant-only loss mask)
    prompts     prompts for generation (regenerate, eval): read, encoded, EOS, the target for generation
    vllm        vLLM as the target's engine: imported, engine arguments, loaded, generate
"""
