"""`dflash-fast serve-target`: the frozen target in a process of its own (on its own GPUs or node), answering each
training step's documents with the per-token fields a store holds.

    trainer rank ──token ids of one forward──▶ serve-target (TargetRunner, or VllmRunner under --tensor-parallel-size)
                 ◀──hidden, last, teacher top-k / lse──

The server runs extraction's runner (make_runner: the tap rule, `last`, the parity check, the teacher, the store
dtype's rounding), so a trainer with `data.online.address=HOST:PORT` gets what its in-process online source would.
The documents are the trainer's: it tokenizes its JSONL and plans its rows as the in-process mode does, and sends
the token ids of each padded forward (OnlineSource.run); one server answers any number of ranks and trainers, one
forward at a time.

The wire (no pickle; every size, name, dtype and shape checked before anything is allocated for it) is
remote.py's, with RemoteRunner, the trainer's end.
"""

import socketserver
import threading
from typing import Dict, List, Sequence, Tuple

import numpy as np

from dflash_fast.errors import ConfigError, UserError
from dflash_fast.extract.plan import ExtractOptions, Job, plan_job
from dflash_fast.extract.remote import MAX_REQUEST_DOCUMENTS, SETTINGS, receive, send, served_fields, token_digests
from dflash_fast.extract.runners import make_runner
from dflash_fast.target.records import Example


def server_settings(job: Job, runner) -> Dict:
    """What a trainer checks at connect (SETTINGS) and what its manifest records about the target."""
    return {
        "engine": job.options.engine,
        **{k: job.identity[k] for k in SETTINGS if k in job.identity},
        "tensor_parallel_size": job.options.tensor_parallel_size,
        "num_layers": runner.num_layers,
        "vocab_size": runner.vocab_size,
        "final_norm": {"kind": runner.norm_kind, "eps": runner.norm_eps, "module": runner.norm_name},
    }


class TargetServer(socketserver.ThreadingTCPServer):
    """A TCP server over one runner: a thread per connection (a trainer rank), one forward at a time. It listens
    from construction, so a port in use fails before the target loads; a trainer that connects before `serve`
    waits for its hello until then."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, host: str, port: int):
        self.lock = threading.Lock()
        super().__init__((host, port), Handler)

    def serve(self, job: Job, runner) -> None:
        self.job, self.runner = job, runner
        self.settings = server_settings(job, runner)
        self.fields = served_fields(job)
        self.serve_forever()

    def run(self, lengths, payload: bytearray) -> Tuple[Dict, List[bytes]]:
        """A run request -> its reply; ValueError for a request that does not fit the job."""
        max_len = self.job.options.max_seq_len
        if (not isinstance(lengths, list) or not 0 < len(lengths) <= MAX_REQUEST_DOCUMENTS
                or not all(isinstance(n, int) and not isinstance(n, bool) and 0 < n <= max_len for n in lengths)):
            raise ValueError(f"lengths must be a list of 1..{MAX_REQUEST_DOCUMENTS} document lengths in "
                             f"1..{max_len} (this server's --max-seq-len)")
        if len(payload) != 4 * sum(lengths):
            raise ValueError(f"{len(payload)} bytes of token ids for {sum(lengths)} tokens (int32)")
        ids = np.frombuffer(payload, dtype="<i4")
        if ids.min() < 0 or ids.max() >= self.runner.vocab_size:
            raise ValueError(f"token ids outside the target's vocabulary 0..{self.runner.vocab_size - 1}")
        examples = [Example(doc, np.zeros(len(doc), dtype=np.bool_)) for doc in np.split(ids, np.cumsum(lengths)[:-1])]
        with self.lock:
            arrays = self.runner(examples)
        header, payload = [], []
        for name, (dtype, shape) in self.fields.items():
            data = np.ascontiguousarray(np.concatenate([a[name] for a in arrays]), dtype=dtype)
            header.append({"name": name, "dtype": dtype.str, "shape": list(data.shape)})
            payload.append(data.data)
        # Each row named by the tokens the runner returned with its states: the trainer checks them on receipt.
        return {"fields": header, "documents": token_digests([a["input_ids"] for a in arrays])}, payload


class Handler(socketserver.BaseRequestHandler):
    """One connection (a trainer rank): requests answered in turn until the trainer hangs up."""

    def handle(self):
        server: TargetServer = self.server
        max_request = 4 * server.job.options.max_seq_len * MAX_REQUEST_DOCUMENTS
        while True:
            try:
                header, payload = receive(self.request, max_request)
            except (EOFError, OSError):  # the trainer is gone
                return
            except ValueError as e:  # something else speaking: say what, and drop the connection
                self.reply({"error": f"bad request: {e}"})
                return
            if not self.reply(*self.answer(header, payload)):
                return

    def answer(self, header: Dict, payload: bytearray) -> Tuple[Dict, Sequence[bytes]]:
        server: TargetServer = self.server
        try:
            if header.get("op") == "hello":
                return {"settings": server.settings}, ()
            if header.get("op") == "run":
                return server.run(header.get("lengths"), payload)
            return {"error": f"unknown op {header.get('op')!r} (hello, run)"}, ()
        except (ValueError, UserError) as e:  # the request's fault, or the target's parity check: say so
            return {"error": str(e)}, ()

    def reply(self, header: Dict, payload: Sequence[bytes] = ()) -> bool:
        """Send; False when the trainer is gone."""
        try:
            send(self.request, header, payload)
        except OSError:
            return False
        return True


def serve(target: str, host: str = "127.0.0.1", port: int = 7400, ready=None, **options) -> None:
    """Load the target as `dflash-fast extract` would (no data) and answer requests until interrupted.
    `ready(address)` is called once the socket listens."""
    if not 0 <= port < 65536:
        raise ConfigError(f"--port {port} is not a TCP port (0..65535; 0: any free one)")
    job = plan_job(target, None, None, ExtractOptions(**options), rank=0, world_size=1)
    try:
        server = TargetServer(host, port)
    except OSError as e:
        raise OSError(f"cannot listen on --host {host} --port {port} ({e}): pick another port, or an address of "
                      "this machine") from None
    with server:
        runner = make_runner(job)
        address = "%s:%d" % server.server_address[:2]
        print(f"serve-target: {target} ({job.options.engine}, layer ids {job.layer_ids}, {job.layout.dtype}, "
              f"top-k {job.options.topk}, max_seq_len {job.options.max_seq_len}) listening on {address}", flush=True)
        if ready is not None:
            ready(address)
        server.serve(job, runner)


def add_arguments(parser) -> None:
    from dflash_fast.extract.extract import add_target_arguments

    add_target_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: this machine only; there is no "
                             "authentication, so listen only on a network the trainers alone reach)")
    parser.add_argument("--port", type=int, default=7400, help="TCP port (default 7400; 0: any free port)")


def run(args) -> int:
    from dflash_fast.extract.extract import options_of

    serve(args.target, args.host, args.port, **options_of(args))
    return 0
