"""The wire between a trainer and `dflash-fast serve-target` (extract/serve.py), and the trainer's end of it.

Protocol (TCP; no pickle anywhere: what comes off the network is untrusted): a message is

    MAGIC (4 bytes) | header length (uint32, big-endian) | payload length (uint64) | JSON header | raw payload

  hello  -> {"settings": {...}}   the server's extraction settings; the trainer refuses any that differ from its own
  run {"lengths": [n, ...]} + int32 token ids  ->  {"fields": [{"name", "dtype", "shape"}, ...], "documents":
         [digest, ...]} + each field's bytes, the documents' tokens concatenated ([sum n, *per-token shape]); or
         {"error": "..."}. `documents` names the reply's rows by their token ids as the server's runner returned
         them with their states (token_digests); the trainer refuses a reply whose rows are not its request's
         documents, in its order: another request's reply, or rows a server put in another order.

Each end checks what it reads before allocating for it: the header's size, the payload's size against what the
request implies (the trainer computes the exact reply size from the layout), every field's name, dtype and shape.
RemoteRunner is a runner like the others (extract/runners.py) over a served target.
"""

import hashlib
import json
import socket
import struct
from typing import Dict, List, Sequence, Tuple

import numpy as np

from dflash_fast.errors import ConfigError, UserError
from dflash_fast.extract.plan import Job
from dflash_fast.target.records import Example

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


def token_digests(documents: Sequence[np.ndarray]) -> List[str]:
    """Each document's token ids -> a 16-hex-digit digest (blake2b-64 of the ids as little-endian int32): the name a
    reply's row carries, so that a row whose states belong to other tokens is refused on receipt."""
    return [hashlib.blake2b(np.ascontiguousarray(d, dtype="<i4").data, digest_size=8).hexdigest() for d in documents]


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
        ours, theirs = token_digests([e.input_ids for e in examples]), reply.get("documents")
        if theirs != ours:
            theirs = theirs if isinstance(theirs, list) else []
            row = next((r for r in range(len(ours)) if theirs[r:r + 1] != ours[r:r + 1]), len(ours))
            raise self._error(f"a reply whose rows are not this request's documents in its order (token digests "
                              f"differ from row {row} of {len(ours)}): the states of other tokens, from a reply to "
                              "another request or rows put in another order; does the server run this version of "
                              "dflash-fast?")
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
