"""Each online row's hidden states belong to that row's tokens (verl-SpeCo #99), where a remote target answers: fake
servers in this process (no target forward, no vLLM) whose states are a function of each row's whole token
sequence, `states_of`, so a row that got another row's states is seen. They answer out of order, fail a request so
it is retried, die so it fails over, answer a request with another's reply, and (the negative controls) send another
row's states under this row's name, which no client can see and the per-row comparison here must catch.

    serve-target (RemoteRunner)  one TCP connection, one request and one reply in turn; each reply names its rows by
                                 their tokens' digests, checked on receipt
    vllm_serve (ServedVllmRunner) one HTTP request per document, to any replica; its file holds the tokens it was
                                 computed for, checked on receipt
    vLLM in process (VllmRunner)  the engine's outputs by position; each file's tokens checked on receipt

The in-process HF path and the real servers: docs/trust.md, "Online rows carry their own tokens' states"."""
import hashlib
import json
import os
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from tiny_targets import make_tiny_target, sample_records, write_jsonl

from dflash_fast.errors import UserError
from dflash_fast.extract.plan import ExtractOptions, plan_job
from dflash_fast.extract.remote import SETTINGS, RemoteRunner, receive, send, served_fields, token_digests
from dflash_fast.extract.vllm_serve import ServedVllmRunner

OPTIONS = dict(layer_ids=[1, 2], max_seq_len=64, dtype="fp32", topk=4)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("rows")
    target = make_tiny_target(root / "target", num_layers=4, hidden_size=32)
    return SimpleNamespace(target=target, data=write_jsonl(root / "data.jsonl", sample_records(12)))


def job_of(tiny, engine):
    return plan_job(tiny.target, tiny.data, None, ExtractOptions(engine=engine, **OPTIONS), "cpu", 0, 1)


def states_of(ids, *shape, salt="", dtype=torch.float32):
    """[len(ids), *shape] values seeded by the row's whole token sequence (and `salt`): two rows' states differ unless
    their tokens are the same."""
    ids = np.ascontiguousarray(ids, dtype="<i4")
    seed = int.from_bytes(hashlib.blake2b(ids.tobytes() + salt.encode(), digest_size=7).digest(), "little")
    x = torch.randn(len(ids), *shape, generator=torch.Generator().manual_seed(seed))
    return x.to(dtype) if dtype.is_floating_point else (x.abs() * 100).to(dtype)


def distinct(examples, n):
    """The first `n` examples whose token sequences differ from one another (rows that could be told apart)."""
    out, seen = [], set()
    for e in examples:
        if e.input_ids.tobytes() not in seen:
            seen.add(e.input_ids.tobytes())
            out.append(e)
    assert len(out) >= n
    return out[:n]


# ---------------------------------------------------------------- the transformers target: rows of other lengths


@pytest.fixture(scope="module")
def uneven(tmp_path_factory):
    """A JSONL of documents of six different lengths, far from max_seq_len: a forward pads and sorts them."""
    words = "the frozen target runs over every document once and hands each row its own states".split()
    records = [{"text": " ".join(words[:n])} for n in (2, 9, 4, 14, 6, 11)]
    return write_jsonl(tmp_path_factory.mktemp("uneven") / "uneven.jsonl", records)


def served_address(target):
    """`dflash-fast serve-target` (transformers) on a thread of this process -> its HOST:PORT."""
    from dflash_fast.extract.serve import serve

    ready, box = threading.Event(), {}
    threading.Thread(target=serve, args=(target, "127.0.0.1", 0, lambda a: (box.setdefault("a", a), ready.set())),
                     kwargs=dict(OPTIONS, parity_every=1), daemon=True).start()
    assert ready.wait(120), "serve-target did not listen"
    return box["a"]


@pytest.mark.parametrize("where", ["in process", "serve-target"])
def test_hf_rows_padded_and_sorted_by_length_hold_what_each_document_gives_alone(tiny, uneven, where):
    """OnlineSource.run pads a step's documents into one forward, longest first (plan_batches), and hands each
    document its rows back: whatever order the step lists them in, each equals its forward alone (unpadded)."""
    from dflash_fast.data.online import OnlineSource

    address = served_address(tiny.target) if where == "serve-target" else ""
    source = OnlineSource(tiny.target, uneven, ExtractOptions(**OPTIONS), "cpu", address=address)
    assert len(set(source.lengths.tolist())) == len(source) == 6 and source.lengths.max() < OPTIONS["max_seq_len"]
    alone = {i: source[i] for i in range(len(source))}
    for items in ([0, 1, 2, 3, 4, 5], [5, 3, 0, 4, 1, 2]):
        together = source.run(items)
        assert sorted(together) == sorted(items)
        for i, got in together.items():
            assert torch.equal(got["input_ids"], alone[i]["input_ids"])
            for name in ("hidden", "last", "teacher_topk_logits", "teacher_lse"):
                # padded vs alone: test_extract's batched-vs-one-by-one bound; another row's states miss it by O(1)
                torch.testing.assert_close(got[name], alone[i][name], rtol=1e-5, atol=2e-5, msg=f"{name} of {i}")


# ---------------------------------------------------------------- serve-target: a reply names its rows


def field_states(ids, name, dtype, shape):
    torch_dtype = torch.from_numpy(np.zeros(0, dtype=dtype)).dtype
    return states_of(ids, *shape, salt=name, dtype=torch_dtype).numpy().astype(dtype)


def assert_rows_are_their_tokens(job, examples, arrays):
    assert len(arrays) == len(examples)
    for e, a in zip(examples, arrays):
        assert np.array_equal(a["input_ids"], e.input_ids)
        for name, (dtype, shape) in served_fields(job).items():
            assert np.array_equal(a[name], field_states(e.input_ids, name, dtype, shape)), \
                f"a row of {len(e.input_ids)} tokens holds another row's {name}"


class FakeTargetServer:
    """`dflash-fast serve-target`'s wire over states_of. `answer(k, documents)` -> (the documents whose states reply k
    carries, the documents it names): by default the request's own, in its order."""

    def __init__(self, job, answer=None):
        self.job, self.fields = job, served_fields(job)
        self.answer = answer or (lambda _k, docs: (docs, docs))
        self.settings = {"engine": job.options.engine, **{k: job.identity[k] for k in SETTINGS if k != "engine"},
                         "num_layers": 4, "vocab_size": 384,
                         "final_norm": {"kind": "plain", "eps": 1e-6, "module": "model.norm"}}
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self.listener.getsockname()[1]
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        conn, _ = self.listener.accept()
        with conn, self.listener:
            runs = 0
            while True:
                try:
                    header, payload = receive(conn, 1 << 30)
                except (EOFError, OSError):
                    return
                if header["op"] == "hello":
                    send(conn, {"settings": self.settings})
                    continue
                ids = np.frombuffer(payload, dtype="<i4")
                carried, named = self.answer(runs, np.split(ids, np.cumsum(header["lengths"])[:-1]))
                runs += 1
                total = sum(len(d) for d in carried)
                described = [{"name": n, "dtype": d.str, "shape": [total, *s]} for n, (d, s) in self.fields.items()]
                send(conn, {"fields": described, "documents": token_digests(named)},
                     [np.concatenate([field_states(doc, n, d, s) for doc in carried]).data
                      for n, (d, s) in self.fields.items()])


@pytest.fixture(scope="module")
def hf_job(tiny):
    return job_of(tiny, "hf")


def test_a_served_targets_rows_are_their_tokens_whatever_order_the_trainer_asks_in(hf_job):
    runner = RemoteRunner(FakeTargetServer(hf_job).address, hf_job)
    examples = distinct(hf_job.examples, 6)
    for order in (examples, examples[::-1], sorted(examples, key=lambda e: len(e.input_ids))):
        assert_rows_are_their_tokens(hf_job, order, runner(order))


REFUSED = r"a reply whose rows are not this request's documents in its order \(token digests differ from row \d+ of 4\)"


def test_a_served_reply_to_another_request_is_refused(hf_job):
    replies = {}

    def stale(k, docs):  # reply k is reply k - 1 again: an earlier answer arriving where this request's is awaited
        replies[k] = docs
        return (replies[k - 1],) * 2 if k > 0 else (docs, docs)

    runner = RemoteRunner(FakeTargetServer(hf_job, stale).address, hf_job)
    examples = distinct(hf_job.examples, 4)
    assert_rows_are_their_tokens(hf_job, examples, runner(examples))
    # The same tokens in another order: the stale reply has exactly the size this request expects.
    with pytest.raises(UserError, match=REFUSED):
        runner(examples[::-1])


def test_a_served_reply_with_its_rows_in_another_order_is_refused(hf_job):
    def reorder(_k, docs):  # a server that answers its rows in an order of its own (here reversed), each named right
        return docs[::-1], docs[::-1]

    runner = RemoteRunner(FakeTargetServer(hf_job, reorder).address, hf_job)
    examples = distinct(hf_job.examples, 4)
    with pytest.raises(UserError, match=REFUSED):
        runner(examples)


def test_negative_control_another_rows_states_under_this_rows_name_fail_the_row_check(hf_job):
    """What no digest can see (a server whose forward mixed the rows up, naming them right), the comparison here
    must: the client accepts this reply, so the tests above would fail if a row got another row's states."""
    runner = RemoteRunner(FakeTargetServer(hf_job, lambda _k, docs: (docs[::-1], docs)).address, hf_job)
    pair = distinct(hf_job.examples, 2)
    arrays = runner(pair)
    with pytest.raises(AssertionError, match="holds another row's"):
        assert_rows_are_their_tokens(hf_job, pair, arrays)


# ---------------------------------------------------------------- vllm_serve: each request's file holds its tokens

# Seconds a held request waits for more to arrive before the held ones are answered.
HOLD_S = 0.5


class FakeReplica(ThreadingHTTPServer):
    """A `vllm serve` with the extraction flags, in this process: each completion writes
    <storage>/<name>-<n>.safetensors with hidden_states = states_of(its prompt) and answers the path, with prompt
    logprobs that are the row's too. `mode` (set after the runner connects; its probe is answered in order):

        in order     each request answered as it comes
        reverse      requests held until none has come for HOLD_S, then answered last come, first served
        fail         HTTP 500 (the request is retried on another replica)
        die          the connection closed unanswered and the replica gone (a replica lost mid-forward)
        hang         no answer until `wake` is set, past the client's timeout; then the file (a stale, late answer)
        crossed      held, then each pair of requests answered with each other's file
        mislabelled  held, each pair's files hold each other's states under their own tokens (the negative control)
    """

    daemon_threads = True

    def __init__(self, storage, name, shape):
        super().__init__(("127.0.0.1", 0), FakeVllmHandler)
        self.storage, self.name, self.shape, self.wake = storage, name, shape, threading.Event()
        self.url = "http://127.0.0.1:%d" % self.server_address[1]
        self.mode, self.count, self.answered = "in order", 0, []
        self.held, self.cond = [], threading.Condition()
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def write(self, ids, hidden):
        with self.cond:
            self.count += 1
            path = os.path.join(self.storage, f"{self.name}-{self.count}.safetensors")
        save_file({"hidden_states": hidden, "token_ids": torch.tensor(ids)}, path + ".tmp")
        os.replace(path + ".tmp", path)  # whole files only, as the connectors write them
        return path

    def hold(self, ids):
        """Wait with the other held requests -> (this request's arrival index, every held request's ids, in arrival
        order); returns on this request's turn: the latest arrival not yet answered goes first."""
        with self.cond:
            index = len(self.held)
            self.held.append(ids)
            self.last = time.monotonic()
            while time.monotonic() - self.last < HOLD_S:
                self.cond.wait(HOLD_S)
            while index != max(set(range(len(self.held))) - set(self.answered)):
                self.cond.wait(0.05)
            return index, list(self.held)

    def done(self, index):
        with self.cond:
            self.answered.append(index)
            self.cond.notify_all()


def logprobs_of(ids):
    """prompt_logprobs as vLLM returns them (None at position 0), each value the row's own."""
    values = states_of(ids, salt="logprob").flatten().tolist()
    return [None] + [{str(t): {"logprob": v}} for t, v in zip(ids[1:], values[1:])]


class FakeVllmHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def reply(self, code, body):
        data = json.dumps(body).encode()
        try:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client gave up (hang): nobody reads this answer
            pass

    def do_GET(self):
        if self.path == "/v1/models":
            return self.reply(200, {"data": [{"id": "fake", "root": None, "max_model_len": 4096}]})
        self.reply(404, {"error": "not found"})

    def do_POST(self):
        replica: FakeReplica = self.server
        ids = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompt"]
        mode = replica.mode
        if mode == "fail":
            return self.reply(500, {"error": "EngineCore died"})
        if mode == "die":  # stops listening, and this connection closes unanswered
            threading.Thread(target=lambda: (replica.shutdown(), replica.server_close()), daemon=True).start()
            self.close_connection = True
            return
        if mode == "hang":
            replica.wake.wait(60)
        index, shape = None, replica.shape
        if mode in ("in order", "hang"):
            path = replica.write(ids, states_of(ids, *shape))
        else:
            index, held = replica.hold(ids)
            partner = held[index ^ 1] if (index ^ 1) < len(held) else held[0]
            if mode == "reverse":
                path = replica.write(ids, states_of(ids, *shape))
            elif mode == "mislabelled":  # this row's tokens and shape, another row's values
                path = replica.write(ids, states_of(ids, *shape, salt="another row"))
            else:  # crossed: the file of the partner's tokens
                path = replica.write(partner, states_of(partner, *shape))
        self.reply(200, {"choices": [{"text": "", "prompt_token_ids": ids, "prompt_logprobs": logprobs_of(ids)}],
                         "kv_transfer_params": {"hidden_states_path": path}})
        if index is not None:
            replica.done(index)


@pytest.fixture(scope="module")
def vllm_job(tiny):
    return job_of(tiny, "vllm")


@pytest.fixture
def replicas_of(vllm_job, tmp_path):
    """-> make(n=2, timeout_s=5.0): `n` fake replicas sharing one storage directory (as docs/engine-target.md
    allows) and a runner connected to them -> (the runner, the replicas). All stopped after the test."""
    made = []

    def make(n=2, timeout_s=5.0):
        shape = (3, 32)  # aux ids 2, 3, 4 (layer ids 1, 2 and `last` of the 4-layer target) x hidden size 32
        replicas = [FakeReplica(str(tmp_path), chr(ord("a") + i), shape) for i in range(n)]
        made.append((ServedVllmRunner(vllm_job, [r.url for r in replicas], timeout_s=timeout_s), replicas))
        return made[-1]

    yield make
    for runner, replicas in made:
        runner.close()
        for replica in replicas:
            replica.wake.set()
            replica.shutdown()
            replica.server_close()


def assert_captures_are_their_tokens(examples, hidden, logprobs):
    assert len(hidden) == len(logprobs) == len(examples)
    for e, h, rows in zip(examples, hidden, logprobs):
        assert torch.equal(h, states_of(e.input_ids, 3, 32)), f"a row of {len(e.input_ids)} tokens holds another row's"
        want = logprobs_of(e.input_ids.tolist())
        assert rows[0] is None and [{int(k): v["logprob"] for k, v in w.items()} for w in want[1:]] == \
            [{k: v.logprob for k, v in r.items()} for r in rows[1:]]


@pytest.mark.parametrize("modes", [("reverse", "reverse"), ("fail", "reverse"), ("die", "in order")])
def test_vllm_serve_rows_are_their_tokens_answered_out_of_order_retried_or_failed_over(vllm_job, replicas_of, tmp_path,
                                                                                      modes):
    runner, replicas = replicas_of()
    for replica, mode in zip(replicas, modes):
        replica.mode = mode
    examples = distinct(vllm_job.examples, 8)
    hidden, logprobs = runner.capture(examples, logprobs=True)
    assert_captures_are_their_tokens(examples, hidden, logprobs)
    if modes[0] == "reverse":
        assert all(len(r.answered) > 1 and r.answered != sorted(r.answered) for r in replicas), \
            "each replica answered its requests out of their order"
    else:
        assert [r.alive for r in runner.replicas] == [False, True]
        assert replicas[1].count == 1 + len(examples), "B answered its probe and every document"
    assert os.listdir(tmp_path) == [], "every file read once and removed"


def test_vllm_serve_a_late_answer_from_a_timed_out_request_lands_in_no_row(vllm_job, replicas_of, tmp_path):
    runner, replicas = replicas_of(timeout_s=2.0)
    replicas[0].mode = "hang"
    examples = distinct(vllm_job.examples, 6)
    hidden, logprobs = runner.capture(examples, logprobs=True)  # A's requests time out and go to B
    assert_captures_are_their_tokens(examples, hidden, logprobs)
    assert [r.alive for r in runner.replicas] == [False, True] and "timed out" in runner.replicas[0].why
    replicas[0].wake.set()
    deadline = time.monotonic() + 10
    while not any(p.startswith("a-") for p in os.listdir(tmp_path)):  # A wakes and writes what nobody awaits
        assert time.monotonic() < deadline, "the hung replica never wrote its late file"
        time.sleep(0.05)
    again = distinct(vllm_job.examples[::-1], 4)  # the next forward, while A's stale files lie in the directory
    hidden, logprobs = runner.capture(again, logprobs=True)
    assert_captures_are_their_tokens(again, hidden, logprobs)
    assert all(p.startswith("a-") for p in os.listdir(tmp_path)), "only A's late files are left: nobody read them"


def test_vllm_serve_a_reply_naming_another_requests_file_is_refused(vllm_job, replicas_of):
    runner, replicas = replicas_of(n=1)
    replicas[0].mode = "crossed"
    with pytest.raises(UserError, match=r"vllm serve at .*: the capture .* holds tokens \[\d+\] and hidden states "
                                        r"\[\d+, 3, 32\], not this request's \d+ tokens"):
        runner.capture(distinct(vllm_job.examples, 4))


def test_negative_control_vllm_serve_states_of_another_row_under_this_rows_tokens_fail_the_row_check(vllm_job,
                                                                                                    replicas_of):
    runner, replicas = replicas_of(n=1)
    replicas[0].mode = "mislabelled"
    examples = distinct(vllm_job.examples, 2)
    hidden, logprobs = runner.capture(examples, logprobs=True)  # accepted: the file says these tokens
    with pytest.raises(AssertionError, match="holds another row's"):
        assert_captures_are_their_tokens(examples, hidden, logprobs)


# ---------------------------------------------------------------- vLLM in process: outputs by position


class FakeEngine:
    """vLLM's LLM as VllmRunner.capture calls it: one file per prompt (states_of its tokens); `generate` returns
    the outputs in `order` (a permutation of the prompts' positions)."""

    def __init__(self, storage, order=None):
        self.storage, self.order = storage, order
        self.llm_engine = SimpleNamespace(step=lambda: None)

    def generate(self, prompts, params, use_tqdm):  # noqa: ARG002 (vLLM's signature)
        outputs = []
        for i, p in enumerate(prompts):
            ids = p["prompt_token_ids"]
            path = os.path.join(self.storage, f"{i}.safetensors")
            save_file({"hidden_states": states_of(ids, 3, 8), "token_ids": torch.tensor(ids)}, path)
            outputs.append(SimpleNamespace(kv_transfer_params={"hidden_states_path": path}, prompt_logprobs=None))
        return [outputs[i] for i in (self.order or range(len(outputs)))]


@pytest.mark.parametrize("order", [None, [1, 0, 3, 2]])
def test_vllm_in_process_outputs_out_of_the_prompts_order_are_refused(hf_job, tmp_path, monkeypatch, order):
    from dflash_fast.extract.vllm_runner import VllmRunner

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(SamplingParams=lambda **_: None))
    runner = object.__new__(VllmRunner)  # its capture alone: no engine, no head
    runner.llm, runner.aux_ids, runner.config = FakeEngine(str(tmp_path), order), [2, 3, 4], SimpleNamespace(
        hidden_size=8)
    examples = distinct(hf_job.examples, 4)
    if order is None:
        captured, _ = runner.capture(examples)
        assert all(torch.equal(h, states_of(e.input_ids, 3, 8)) for e, h in zip(examples, captured))
    else:
        with pytest.raises(UserError, match=r"vLLM's capture .* holds tokens \[\d+\] and hidden states \[\d+, 3, 8\], "
                                            r"not this request's \d+ tokens"):
            runner.capture(examples)
