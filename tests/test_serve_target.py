"""A served target (`dflash-fast serve-target`, data.online.address): the trainer gets from the server exactly what
its in-process online source would give, resumes exactly, refuses a server whose settings differ, and turns any
malformed reply into one error naming the address. The server here runs transformers (--engine hf) in a thread of
the test process; tests/test_vllm_serve.py serves the target with vLLM."""
import json
import socket
import threading

import numpy as np
import pytest
from launch_env import launch_env
from test_online import LAYER_IDS, MAX_SEQ_LEN, TINY_YAML, config, tiny  # noqa: F401  (tiny: the module fixture)
from test_trainer import STOP_AND_RESUME, exported, losses, stopped_by_sigterm

from dflash_fast.errors import UserError
from dflash_fast.extract.plan import ExtractOptions, plan_job
from dflash_fast.extract.remote import MAGIC, PREFIX, SETTINGS, RemoteRunner, receive, send
from dflash_fast.extract.serve import serve
from dflash_fast.train.config import ConfigError, load_config
from dflash_fast.train.trainer import train

SERVED = dict(layer_ids=LAYER_IDS, max_seq_len=MAX_SEQ_LEN, dtype="fp32", topk=8, parity_every=1)


def start_server(target, **options):
    """`serve(target, port=0, **options)` on a daemon thread -> its HOST:PORT once it listens."""
    ready, box = threading.Event(), {}

    def listening(address):
        box["address"] = address
        ready.set()

    thread = threading.Thread(target=serve, args=(target, "127.0.0.1", 0, listening), kwargs=options, daemon=True)
    thread.start()
    assert ready.wait(120), "serve-target did not listen within 120 s"
    return box["address"]


@pytest.fixture(scope="module")
def served(tiny):  # noqa: F811
    return start_server(tiny.target, **SERVED)


def served_config(tiny, out, address, **extra):  # noqa: F811
    return config(tiny, out, "online", data__online__address=address, data__online__topk=SERVED["topk"], **extra)


def trainer_job(tiny, **options):  # noqa: F811
    return plan_job(tiny.target, tiny.data, None, ExtractOptions(**{**SERVED, **options}), "cpu", 0, 1)


def no_target_in_the_trainer(monkeypatch):
    def refuse(*_args, **_kwargs):
        raise AssertionError("a trainer with data.online.address loaded the target itself")

    monkeypatch.setattr("dflash_fast.extract.runners.load_target", refuse)


@pytest.fixture(scope="module")
def served_run(tiny, served, tmp_path_factory):  # noqa: F811
    """The output directory of an uninterrupted run (STOP_AND_RESUME's 9 steps) on the served target."""
    out = str(tmp_path_factory.mktemp("served_run"))
    with pytest.MonkeyPatch.context() as monkeypatch:
        no_target_in_the_trainer(monkeypatch)
        train(served_config(tiny, out, served, **STOP_AND_RESUME))
    return out


def test_served_target_trains_the_in_process_online_steps(tiny, served_run, tmp_path):  # noqa: F811
    here = str(tmp_path / "here")
    train(config(tiny, here, "online", data__online__topk=SERVED["topk"], **STOP_AND_RESUME))
    assert losses(served_run) == losses(here) and len(losses(here)) == 9
    a, b = exported(here), exported(served_run)
    assert all(np.array_equal(a[k].numpy(), b[k].numpy()) for k in a)


def test_served_target_stop_by_sigterm_and_resume_equals_an_uninterrupted_run(tiny, served, served_run,  # noqa: F811
                                                                            tmp_path, monkeypatch):
    no_target_in_the_trainer(monkeypatch)
    parts = str(tmp_path / "parts")
    stopped = stopped_by_sigterm(lambda: train(served_config(tiny, parts, served, **STOP_AND_RESUME)), 5)
    assert stopped["interrupted"] and stopped["step"] == 5
    resumed = train(served_config(tiny, parts, served, checkpoint__resume="latest", **STOP_AND_RESUME))
    assert resumed["step"] == 9 and not resumed["interrupted"]
    assert losses(parts) == losses(served_run), "stop + resume must reproduce the uninterrupted losses step for step"


@pytest.mark.parametrize("option, value", [("topk", 4), ("dtype", "fp16"), ("layer_ids", [0, 2]),
                                           ("max_seq_len", 48), ("no_last", True)])
def test_a_served_target_with_other_settings_is_refused_naming_both_values(tiny, served, option, value):  # noqa: F811
    job = trainer_job(tiny, **{option: value})
    key = {"no_last": "has_last"}.get(option, option)
    with pytest.raises(UserError, match=rf"the target served at {served} runs {key}=.*, this trainer asks {key}="):
        RemoteRunner(served, job)


def test_the_served_fields_are_the_in_process_runners(tiny, served):  # noqa: F811
    from dflash_fast.extract.runners import make_runner

    job = trainer_job(tiny)
    remote, local = RemoteRunner(served, job), make_runner(job)
    examples = job.examples[:3]
    for a, b in zip(remote(examples), local(examples)):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key].dtype == b[key].dtype and np.array_equal(a[key], b[key]), key


def raw_request(address, header, payload=b""):
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as sock:
        send(sock, header, [payload])
        return receive(sock, 1 << 30)[0]


@pytest.mark.parametrize("lengths, ids, match", [
    ([3], [1, 2, 10**6], "outside the target's vocabulary"),
    ([MAX_SEQ_LEN + 1], [1] * (MAX_SEQ_LEN + 1), "document lengths in 1..64"),
    ([4], [1, 2, 3], "12 bytes of token ids for 4 tokens"),
    ([3], [1, 2, 3, 4], "16 bytes of token ids for 3 tokens"),  # longer: the extra ids must not join the last document
    ("x", [], "lengths must be a list"),
])
def test_the_server_answers_a_bad_request_with_an_error_not_a_crash(served, lengths, ids, match):
    reply = raw_request(served, {"op": "run", "lengths": lengths}, np.asarray(ids, dtype="<i4").tobytes())
    assert match in reply["error"]
    assert "settings" in raw_request(served, {"op": "hello"}), "the server must still answer"


# ---------------------------------------------------------------- a fake server: what the trainer accepts


def fake_server(settings, reply):
    """A one-connection server: answers hello with `settings`, then one run with `reply(request_header, token ids)`
    -> raw bytes. -> its address."""
    listener = socket.create_server(("127.0.0.1", 0))

    def answer():
        conn, _ = listener.accept()
        with conn, listener:
            header, _ = receive(conn, 1 << 30)
            send(conn, {"settings": settings})
            header, payload = receive(conn, 1 << 30)
            conn.sendall(reply(header, np.frombuffer(payload, dtype="<i4")))

    threading.Thread(target=answer, daemon=True).start()
    return "127.0.0.1:%d" % listener.getsockname()[1]


def message(header, payload=b"", magic=MAGIC, header_size=None, payload_size=None):
    body = json.dumps(header).encode()
    return PREFIX.pack(magic, len(body) if header_size is None else header_size,
                       len(payload) if payload_size is None else payload_size) + body + payload


def good_reply(job, header, ids):
    """The reply a real server gives, with zeros: -> (its header, its payload)."""
    from dflash_fast.extract.remote import served_fields, token_digests

    total = sum(header["lengths"])
    fields = [{"name": n, "dtype": d.str, "shape": [total, *s]} for n, (d, s) in served_fields(job).items()]
    payload = b"".join(np.zeros([total, *s], dtype=d).tobytes() for d, s in served_fields(job).values())
    documents = token_digests(np.split(ids, np.cumsum(header["lengths"])[:-1]))
    return {"fields": fields, "documents": documents}, payload


@pytest.fixture(scope="module")
def job(tiny):  # noqa: F811
    return trainer_job(tiny)


def settings_of(job):
    return {"engine": "hf", **{k: job.identity[k] for k in SETTINGS if k != "engine"}, "num_layers": 4,
            "vocab_size": 384, "final_norm": {"kind": "plain", "eps": 1e-6, "module": "model.norm"}}


def test_a_well_formed_reply_is_accepted(job):
    address = fake_server(settings_of(job), lambda h, ids: message(*good_reply(job, h, ids)))
    out = RemoteRunner(address, job)(job.examples[:2])
    assert [len(a["hidden"]) for a in out] == [len(e.input_ids) for e in job.examples[:2]]


def tampered(job, how):
    def reply(header, ids):
        fields, payload = good_reply(job, header, ids)
        if how == "dtype":
            fields["fields"][0]["dtype"] = "<f8"
        elif how == "shape":
            fields["fields"][0]["shape"][0] += 1
        elif how == "short":
            return message(fields, payload[:-4])
        elif how == "oversized":
            return message(fields, b"", payload_size=1 << 40)
        elif how == "header":
            return message(fields, header_size=1 << 30)
        elif how == "not json":
            return PREFIX.pack(MAGIC, 3, 0) + b"{x]"
        elif how == "magic":
            return message(fields, payload, magic=b"HTTP")
        elif how == "closed":
            return message(fields, payload)[:20]
        elif how == "no documents":  # a server of an older version: its rows are not named
            del fields["documents"]
        return message(fields, payload)
    return reply


@pytest.mark.parametrize("how", ["dtype", "shape", "short", "oversized", "header", "not json", "magic", "closed",
                                 "no documents"])
def test_a_malformed_reply_is_one_error_naming_the_address(job, how):
    address = fake_server(settings_of(job), tampered(job, how))
    runner = RemoteRunner(address, job)
    with pytest.raises(UserError, match=rf"^the target server at data.online.address={address}: ") as e:
        runner(job.examples[:2])
    assert "\n" not in str(e.value)


def test_an_unreachable_server_is_one_error_naming_the_address(job):
    listener = socket.create_server(("127.0.0.1", 0))
    address = "127.0.0.1:%d" % listener.getsockname()[1]
    listener.close()
    with pytest.raises(UserError, match=rf"cannot reach the target server at data.online.address={address}"):
        RemoteRunner(address, job)


@pytest.mark.parametrize("address", ["nohost", "host:0", "host:99999", ":80", "h:x1"])
def test_a_malformed_address_is_a_config_error_naming_the_key(address):
    with pytest.raises(ConfigError, match=r"data.online.address=.* is not HOST:PORT"):
        load_config(TINY_YAML, ["data.source=online", "model.target=t", "data.jsonl=x",
                                f"data.online.address={address}"])


def test_one_server_answers_several_trainer_ranks_connected_at_once(tiny, served):  # noqa: F811
    job = trainer_job(tiny)
    first = RemoteRunner(served, job)  # holds its connection open, as a rank does for the whole run
    second = {}
    thread = threading.Thread(target=lambda: second.setdefault("out", RemoteRunner(served, job)(job.examples[:1])),
                              daemon=True)
    thread.start()
    thread.join(60)
    assert "out" in second, "a second rank got no answer while the first stayed connected"
    assert np.array_equal(first(job.examples[:1])[0]["hidden"], second["out"][0]["hidden"])


def test_data_source_vllm_at_an_address_is_not_refused_under_several_ranks(tiny, served, monkeypatch):  # noqa: F811
    import torch

    from dflash_fast.train.data import open_source

    cfg = served_config(tiny, "unused", served, data__source="vllm")
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    # Past the one-rank refusal to the server, which serves transformers, not vLLM: refused by the settings check.
    with pytest.raises(UserError, match=rf"the target served at {served} runs engine='hf' \(--engine\), this "
                                        r"trainer asks engine='vllm'"):
        open_source(cfg)


def test_two_trainer_ranks_on_one_served_target_train_the_one_rank_steps(tiny, served, tmp_path,  # noqa: F811
                                                                         monkeypatch):
    """One launch of 2 gloo ranks, each asking the server for its own rows, against 1 rank with 2 micro-batches
    (the same global batch) in process."""
    import os
    import subprocess
    import sys

    from test_online import REPO, settings

    from dflash_fast.extract.serve import TargetServer
    from dflash_fast.train.distributed import free_port

    answered, real_run = set(), TargetServer.run

    def run(server, lengths, payload):  # the server runs in this process: note which connection asked
        answered.add(threading.current_thread().name)
        return real_run(server, lengths, payload)

    monkeypatch.setattr(TargetServer, "run", run)

    common = dict(schedule__steps=3, data__online__topk=SERVED["topk"])
    one = str(tmp_path / "one")
    train(config(tiny, one, "online", schedule__grad_accum=2, **common))
    env = launch_env()
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    cmd = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", "2", "--master_port",
           str(free_port()), os.path.join(REPO, "tests", "test_trainer_launch.py"), str(tmp_path / "two"),
           os.path.join(REPO, "configs", "ds_zero1.json"), TINY_YAML,
           *settings(tiny, "unused", "online", data__online__address=served, **common)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(answered) >= 2, f"the forwards came over {len(answered)} connection(s), not one per rank"
    got, want = losses(str(tmp_path / "two" / "run0")), losses(one)
    assert got.keys() == want.keys() and len(want) == 3
    assert all(got[step] == pytest.approx(loss, rel=1e-5) for step, loss in want.items())


def test_serve_target_on_a_port_in_use_is_one_error_line_naming_it(tiny, served, capsys):  # noqa: F811
    from dflash_fast import cli

    port = served.rsplit(":", 1)[1]
    argv = ["serve-target", "--target", tiny.target, "--port", port, "--layer-ids", "1,2", "--dtype", "fp32"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot listen on --host 127.0.0.1 --port {port}") and err.count("\n") == 1
    assert cli.main([*argv[:4], "70000"]) == 2
    assert capsys.readouterr().err.startswith("error: --port 70000 is not a TCP port")
