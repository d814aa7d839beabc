"""`dflash-fast serve-target`: the frozen target in a process of its own (on its own GPUs or node), answering each
training step's documents with the per-token fields a store holds; `RemoteRunner`, the trainer's end of it.

    trainer rank ──token ids of one forward──▶ serve-target (TargetRunner, or VllmRunner under --tensor-parallel-size)
                 ◀──hidden, last, teacher top-k / lse──

The server runs extraction's runner (make_runner: the tap rule, `last`, the parity check, the teacher, the store
dtype's rounding), so a trainer with `data.online.address=HOST:PORT` gets what its in-process online source would.
The documents are the trainer's: it tokenizes its JSONL and plans its rows as the in-process mode does, and sends
the token ids of each padded forward (OnlineSource.run); one server answers any number of ranks and trainers, one
forward at a time.

Protocol (TCP; no pickle anywhere: what comes off the network is untrusted): a message is

    MAGIC (4 bytes) | header length (uint32, big-endian) | payload length (uint64) | JSON header | raw payload

  hello  -> {"settings": {...}}   the server's extraction settings; the trainer refuses any that differ from its own
  run {"lengths": [n, ...]} + int32 token ids  ->  {"fields": [{"name", "dtype", "shape"}, ...]} + each field's
         bytes, the documents' tokens concatenated ([sum n, *per-token shape]); or {"error": "..."}

Each end checks what it reads before allocating for it: the header's size, the payload's size against what the
request implies (the trainer computes the exact reply size from the layout), every field's name, dtype and shape.
"""
import json
import socket
import socketserver
import struct
import threading
from typing import Dict, List, Sequence, Tuple

import numpy as np

from dflash_fast.errors import ConfigError, UserError
from dflash_fast.plan import ExtractOptions, Job, make_runner, plan_job
from dflash_fast.records import Example

MAGIC = b"DFT1"
PREFIX = struct.Struct(">4sIQ")
MAX_HEADER_BYTES = 1 << 20
MAX_REQUEST_DOCUMENTS = 1 << 16
CONNECT_TIMEOUT_S = 30.0
# The settings both ends must share, and the trainer's config key / the server's flag that sets each.
SETTINGS = {
    "engine": ("data.source (online: hf, vllm: vllm)", "--engine"),
    "target_config_sha256": ("model.target", "--target"),
    "layer_ids": ("model.layer_ids", "--layer-ids"),
    "dtype": ("data.online.dtype", "--dtype"),
    "compute_dtype": ("the device: bf16 on a GPU unless fp32", "the device"),
    "has_last": ("loss.kind (auto / kl need `last`)", "--no-last"),
    "topk": ("data.online.topk", "--topk"),
    "max_seq_len": ("data.online.max_seq_len", "--max-seq-len"),
}


def parse_address(address: str) -> Tuple[str, int]:
    """'HOST:PORT' -> (host, port); ConfigError naming data.online.address otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"data.online.address={address!r} is not HOST:PORT (e.g. 10.0.0.5:7400): the address "
                          "`dflash-fast serve-target --host HOST --port PORT` listens on")
    return host.strip("[]"), int(port)


def send(sock: socket.socket, header: Dict, payload: Sequence[bytes] = ()) -> None:
    body = json.dumps(header).encode()
    size = sum(len(memoryview(p).cast("B")) for p in payload)
    sock.sendall(PREFIX.pack(MAGIC, len(body), size) + body)
    for part in payload:
        sock.sendall(part)


def _read_exactly(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise (EOFError if got == 0 else ConnectionError)(f"the connection closed after {got} of {n} bytes")
        got += k
    return buf


def receive(sock: socket.socket, max_payload: int) -> Tuple[Dict, bytearray]:
    """One message -> (header, payload); ValueError on a bad prefix, an oversized header or payload, or a header
    that is not a JSON object; EOFError when the peer closed before the message began. The payload is read only
    once its announced size is known to fit."""
    magic, header_size, payload_size = PREFIX.unpack(_read_exactly(sock, PREFIX.size))
    if magic != MAGIC:
        raise ValueError(f"not a dflash-fast target message (starts with {bytes(magic)!r}, not {MAGIC!r})")
    if header_size > MAX_HEADER_BYTES:
        raise ValueError(f"a header of {header_size} bytes (at most {MAX_HEADER_BYTES})")
    if payload_size > max_payload:
        raise ValueError(f"a payload of {payload_size} bytes where at most {max_payload} are expected")
    try:
        header = json.loads(_read_exactly(sock, header_size))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ValueError(f"a header that is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"a header that is not a JSON object ({type(header).__name__})")
    return header, _read_exactly(sock, payload_size)


def served_fields(job: Job) -> Dict[str, Tuple[np.dtype, tuple]]:
    """name -> (numpy dtype, per-token shape) of what the server sends: the store's fields but the trainer's own
    input_ids and loss_mask."""
    return {name: (np.dtype(d).newbyteorder("<"), shape) for name, (d, shape, _) in job.layout.fields().items()
            if name not in ("input_ids", "loss_mask")}  # little-endian on the wire, whatever the machines


# ---------------------------------------------------------------- the server


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
        return {"fields": header}, payload


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
    from dflash_fast.extract import add_target_arguments

    add_target_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: this machine only; there is no "
                             "authentication, so listen only on a network the trainers alone reach)")
    parser.add_argument("--port", type=int, default=7400, help="TCP port (default 7400; 0: any free port)")


def run(args) -> int:
    serve(args.target, args.host, args.port, layer_ids=args.layer_ids, num_tapped=args.num_tapped,
          max_seq_len=args.max_seq_len, dtype=args.dtype, topk=args.topk, no_last=args.no_last,
          trust_remote_code=args.trust_remote_code, parity_every=args.parity_every, engine=args.engine,
          tensor_parallel_size=args.tensor_parallel_size)
    return 0


# ---------------------------------------------------------------- the trainer's end


class RemoteRunner:
    """TargetRunner's interface (`runner(examples)` -> per-document arrays in the store's layout, and the target
    facts job_manifest records) over a served target at `address`, whose settings are checked against `job`'s."""

    def __init__(self, address: str, job: Job):
        self.address, self.job = address, job
        self.fields = served_fields(job)
        host, port = parse_address(address)
        try:
            self.sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
            self.sock.settimeout(None)  # a forward takes what it takes
        except OSError as e:
            raise UserError(f"cannot reach the target server at data.online.address={address} ({e}): start it "
                            "with `dflash-fast serve-target --target ... --host HOST --port PORT`") from None
        settings = self._ask({"op": "hello"}, 0)[0].get("settings")
        if not isinstance(settings, dict):
            raise self._error("its hello reply holds no settings")
        ours = {"engine": job.options.engine, **job.identity}
        for key, (config_key, flag) in SETTINGS.items():
            if settings.get(key) != ours[key]:
                raise UserError(f"the target served at {address} runs {key}={settings.get(key)!r} ({flag}), this "
                                f"trainer asks {key}={ours[key]!r} ({config_key}): serve the target with the "
                                "trainer's settings or change the config")
        try:
            norm = settings["final_norm"]
            self.num_layers, self.vocab_size = int(settings["num_layers"]), int(settings["vocab_size"])
            self.norm_kind, self.norm_eps, self.norm_name = str(norm["kind"]), float(norm["eps"]), str(norm["module"])
        except (KeyError, TypeError, ValueError) as e:
            raise self._error(f"its settings lack or mistype {e}") from None
        self.model = None  # job_manifest names the architecture from the target's config

    def _error(self, what: str) -> UserError:
        return UserError(f"the target server at data.online.address={self.address}: {what}")

    def _ask(self, header: Dict, max_payload: int, payload: Sequence[bytes] = ()) -> Tuple[Dict, bytearray]:
        try:
            send(self.sock, header, payload)
            reply, data = receive(self.sock, max_payload)
        except (ValueError, OSError, EOFError) as e:
            raise self._error(f"a bad or missing reply ({e})") from None
        if "error" in reply:
            raise self._error(str(reply["error"]))
        return reply, data

    def __call__(self, examples: Sequence[Example]) -> List[Dict[str, np.ndarray]]:
        lengths = [len(e.input_ids) for e in examples]
        total = sum(lengths)
        sizes = {name: total * dtype.itemsize * int(np.prod(shape, dtype=np.int64))
                 for name, (dtype, shape) in self.fields.items()}
        ids = np.concatenate([e.input_ids for e in examples]).astype("<i4")
        reply, data = self._ask({"op": "run", "lengths": lengths}, sum(sizes.values()), [ids.data])
        described = reply.get("fields")
        want = [{"name": name, "dtype": dtype.str, "shape": [total, *shape]}
                for name, (dtype, shape) in self.fields.items()]
        if described != want or len(data) != sum(sizes.values()):
            raise self._error(f"a reply of fields {described} in {len(data)} bytes, not this request's {want} in "
                              f"{sum(sizes.values())} bytes: does the server run this version of dflash-fast?")
        out = [{"input_ids": e.input_ids, "loss_mask": e.loss_mask} for e in examples]
        offset = 0
        for name, (dtype, shape) in self.fields.items():
            count = total * int(np.prod(shape, dtype=np.int64))
            array = np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(total, *shape)
            offset += sizes[name]
            for doc, part in zip(out, np.split(array, np.cumsum(lengths)[:-1])):
                doc[name] = part
        return out

    def close(self) -> None:
        self.sock.close()
