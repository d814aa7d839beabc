"""`dflash-fast regenerate`: the target writes the responses a drafter will learn to draft.

    prompts JSONL ──chat template──▶ batched HF generate (left padding) ──▶ JSONL with the assistant turn
                                     (--engine vllm: vLLM's generate, dflash_fast/evaluate/vllm.py)

DFlash drafters are trained on the target's own outputs. A prompt line is
`{"conversations": [...]}` (the prompt is every turn up to and including the
last user turn; a reply already after it is replaced) or `{"text": ...}` (the
target continues the text). Each output line is the input record with the
response in place, plus `"index"` (the prompt's 0-based record number),
`"finished"` (the target stopped at its end-of-sequence token) and `"sampling"`
(the engine and settings that wrote it):

    {"index": 3, "conversations": [..., {"role": "user", ...}, "
    "{"role": "assistant", "content": RESPONSE}], "finished": true, "sampling": {"engine": "hf", ...}}
    {"index": 4, "text": PROMPT + RESPONSE, "finished": false, "sampling": {...}}

so `dflash-fast extract` reads the file as it is. Prompts are cut into fixed
batches of `batch_size` consecutive records; each batch is appended in one
write, flushed and fsync'ed. A re-run with the same arguments skips the
indices already in the file (a torn last line is cut off first), so an
interrupted run resumes without duplicating or dropping a prompt; sampling is
seeded per batch, so the resumed file matches an uninterrupted run.
"""

import json
import os
from typing import Dict, List, Optional, Sequence, Set, Union

import torch

from dflash_fast.errors import COUNT, LIST, STR, Obj, schema_problem
from dflash_fast.flags import call_with_flags
from dflash_fast.target.load import check_target
from dflash_fast.target.prompts import (
    ENGINES,
    Prompt,
    add_model_arguments,
    cut_response,
    decode_reply,
    encode_prompt,
    eos_token_ids,
    load_model,
    read_prompts,
    thinking_switch,
)


def output_record(prompt: Prompt, response: Union[str, Dict[str, str]], finished: bool, sampling: Dict,
                  template_kwargs: Optional[Dict] = None) -> Dict:
    """The input record with the response in place: a string, or the assistant turn's fields (decode_reply:
    gpt-oss's `thinking` and `content`); `sampling`: the engine and settings that wrote it; `template_kwargs`: the
    chat template's switch the prompt was rendered with (--thinking), kept as `chat_template_kwargs` so extraction
    renders the conversation as the target saw it."""
    reply = {"content": response} if isinstance(response, str) else response
    record = dict(prompt.record, index=prompt.index, finished=finished, sampling=sampling)
    if prompt.messages is not None:
        record["conversations"] = prompt.messages + [{"role": "assistant", **reply}]
        if template_kwargs:
            record["chat_template_kwargs"] = dict(record.get("chat_template_kwargs") or {}, **template_kwargs)
    else:
        record["text"] = prompt.text + reply["content"]
    return record


def _matches(prompt: Prompt, record: Dict) -> bool:
    if prompt.messages is not None:
        return record.get("conversations", [])[:-1] == prompt.messages
    return isinstance(record.get("text"), str) and record["text"].startswith(prompt.text)


# The shape of one line regenerate writes (errors.check_schema): the prompt's index and its conversation or text.
RESPONSE = Obj({"index": COUNT}, optional={"conversations": LIST, "text": STR})


def settings_line(sampling: Optional[Dict]) -> str:
    """A record's `sampling` as its flags read: engine, temperature, top_p, top_k, seed, max_new_tokens, thinking."""
    if not isinstance(sampling, dict):
        return "settings it does not record"
    return ", ".join([f"{k}={v}" for k, v in sampling.items() if k != "thinking"]
                     + [f"thinking={sampling.get('thinking') or 'the template default'}"])


def read_done(out: str, prompts: Sequence[Prompt], sampling: Dict) -> Set[int]:
    """Indices already in `out`. Cuts a torn last line off the file; refuses records of other prompts, and records
    written with other `sampling` settings (engine, temperature, top_p, top_k, seed, max_new_tokens, --thinking):
    a resume would mix responses of two distributions in one file."""
    if not os.path.exists(out):
        return set()
    with open(out, "rb") as f:
        data = f.read()
    complete = data[: data.rfind(b"\n") + 1]
    if len(complete) < len(data):
        with open(out, "r+b") as f:
            f.truncate(len(complete))
    done = set()
    for line_no, line in enumerate(complete.decode().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError) as e:
            raise ValueError(f"{out}:{line_no} is not valid JSON ({e}); write to a new --out or delete {out}") from None
        problem = schema_problem(record, RESPONSE, root="the line")
        if problem is not None:
            raise ValueError(f"{out}:{line_no}: {problem}: not a response of regenerate; write to a new --out or "
                             f"delete {out}")
        i = record["index"]
        if not 0 <= i < len(prompts) or not _matches(prompts[i], record):
            raise ValueError(
                f"{out}:{line_no} is not a response to prompt {i!r} of this prompt file; "
                f"write to a new --out or delete {out}"
            )
        if record.get("sampling") != sampling:
            raise ValueError(
                f"{out}:{line_no} was written with {settings_line(record.get('sampling'))}; this run asks for "
                f"{settings_line(sampling)}: resuming would mix the two in one file; rerun with the settings it was "
                f"written with, or write to a new --out"
            )
        if i in done:
            raise ValueError(f"{out}:{line_no}: prompt {i} appears twice; the file was not written by regenerate")
        done.add(i)
    return done


def generate_batch(
    model,
    batch: Sequence[List[int]],
    max_new_tokens: int,
    eos: List[int],
    pad_id: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
) -> List[List[int]]:
    """Left-padded batched generate -> each prompt's new tokens, cut after its first eos."""
    width = max(len(ids) for ids in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for r, ids in enumerate(batch):
        input_ids[r, width - len(ids) :] = torch.tensor(ids)
        mask[r, width - len(ids) :] = 1
    # Every sampling knob is passed explicitly: a target's generation_config.json (e.g. Qwen3's top_k=20) must not
    # add its own.
    sampling = dict(do_sample=False)
    if temperature > 0:
        sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k)
    device = next(model.parameters()).device
    out = model.generate(
        input_ids=input_ids.to(device),
        attention_mask=mask.to(device),
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=pad_id,
        **sampling,
    )
    return [cut_response(row, max_new_tokens, eos) for row in out[:, width:].tolist()]


def regenerate(
    target: str,
    data: Union[str, Sequence[Dict]],
    out: str,
    batch_size: int = 8,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    num_prompts: Optional[int] = None,
    device=None,
    dtype: Optional[str] = None,
    trust_remote_code: bool = False,
    progress: bool = True,
    engine: str = "hf",
    split: str = "train",
    thinking: Optional[str] = None,
) -> Dict:
    """Write the target's responses to the prompts in `data` into `out` (JSONL); resume a partial `out`.

    temperature 0 is greedy decoding; above 0, sampling with `top_p` and `top_k` (0 = off), seeded per batch by `seed`.
    engine: "hf" (transformers' generate) or "vllm" (dflash_fast.evaluate.vllm); every record says which and with
    what settings (`sampling`). `data` may be a Hugging Face dataset (its `split`; datasets_in).
    `thinking` "on" / "off" sets the chat template's thinking switch (prompts.thinking_switch: Qwen3's
    enable_thinking, gpt-oss's reasoning_effort), recorded in each record's `chat_template_kwargs`. A gpt-oss
    reply is split into its analysis (`thinking`) and final (`content`) channels, a function call into
    `tool_calls` (prompts.decode_reply, harmony.split_channels).
    Returns {"out", "prompts", "written", "skipped", "finished", "unsplit"} (finished: responses that
    ended at eos; unsplit: harmony replies not analysis / final messages or a function call, kept as text).
    """
    from tqdm import tqdm
    from transformers import AutoTokenizer

    if batch_size < 1 or max_new_tokens < 1:
        raise ValueError(f"batch_size ({batch_size}) and max_new_tokens ({max_new_tokens}) must be >= 1")
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r}: choose one of {ENGINES}")
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise ValueError(
            f"need temperature >= 0 (0 = greedy), top_p in (0, 1], top_k >= 0; got {temperature}, {top_p}, {top_k}"
        )
    if thinking not in (None, "on", "off"):
        raise ValueError(f"thinking {thinking!r}: choose on or off (or leave it out: the template's default)")
    check_target(target)
    sampling = dict(engine=engine, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                    max_new_tokens=max_new_tokens, **({"thinking": thinking} if thinking else {}))
    prompts = read_prompts(data, num_prompts, split)
    done = read_done(out, prompts, sampling)
    summary = {"out": out, "prompts": len(prompts), "written": 0, "skipped": len(done), "finished": 0, "unsplit": 0}
    if len(done) == len(prompts):
        return summary
    tokenizer = AutoTokenizer.from_pretrained(target, trust_remote_code=trust_remote_code)
    think = None if thinking is None else thinking == "on"
    switch = thinking_switch(tokenizer, think)  # a template without the switch is refused before the model loads
    if engine == "vllm":
        from transformers import GenerationConfig

        from dflash_fast.target.vllm import generate, load_engine

        generation_config = GenerationConfig.from_pretrained(target, trust_remote_code=trust_remote_code)
    else:
        model = load_model(target, device, dtype, trust_remote_code)
        generation_config = model.generation_config
    eos = eos_token_ids(generation_config, tokenizer)
    if not eos:
        raise ValueError(f"{target} defines no eos token: responses would never end before max_new_tokens")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    if engine == "vllm":
        llm = load_engine(target, dtype=dtype, trust_remote_code=trust_remote_code)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    bar = tqdm(total=len(prompts), initial=len(done), unit="prompt", desc="regenerate", disable=not progress)
    with open(out, "a") as f:
        for start in range(0, len(prompts), batch_size):
            todo = [p for p in prompts[start : start + batch_size] if p.index not in done]
            if not todo:
                continue
            batch = [encode_prompt(tokenizer, p, think) for p in todo]
            # Seeded by the batch's position, not by what ran before: a resumed run draws the same samples.
            batch_seed = seed * 1_000_003 + start
            if engine == "vllm":
                _, responses = generate(llm, batch, max_new_tokens, eos, temperature, top_p, top_k, batch_seed)
            else:
                torch.manual_seed(batch_seed)
                responses = generate_batch(model, batch, max_new_tokens, eos, pad_id, temperature, top_p, top_k)
            lines = []
            for p, ids in zip(todo, responses):
                finished = bool(ids) and ids[-1] in eos
                summary["finished"] += finished
                reply = decode_reply(tokenizer, ids)
                if reply is None:  # a harmony reply of other messages: kept as its text
                    summary["unsplit"] += 1
                    reply = tokenizer.decode(ids, skip_special_tokens=True)
                record = output_record(p, reply, finished, sampling, switch)
                lines.append(json.dumps(record) + "\n")
            f.write("".join(lines))
            f.flush()
            os.fsync(f.fileno())
            summary["written"] += len(todo)
            bar.update(len(todo))
    bar.close()
    return summary


def add_arguments(parser) -> None:
    p = parser
    p.add_argument("--target", required=True, help="Hugging Face causal LM: local directory or hub id")
    p.add_argument(
        "--data", required=True, help="prompts JSONL: {conversations: [...]} (last turn the user's) or {text: ...}; "
                                      "or a Hugging Face dataset (save_to_disk directory, .parquet, .arrow, hub id)"
    )
    p.add_argument("--split", default="train", help="the split of a Hugging Face dataset (default train)")
    p.add_argument("--out", required=True, help="output JSONL (re-run the same command to resume)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per generate call (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="response length limit (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass when sampling (default 1.0)")
    p.add_argument("--top-k", type=int, default=0, help="top-k cut when sampling, 0 = off (default)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--num-prompts", "--max-samples", type=int, default=None, dest="num_prompts",
                   help="use only the first N prompts (records / dataset rows)")
    p.add_argument("--engine", choices=ENGINES, default="hf",
                   help="hf: transformers' generate (default); vllm: vLLM (docs/vllm.md), for large prompt sets")
    p.add_argument("--thinking", choices=["on", "off"], default=None,
                   help="the chat template's thinking switch (Qwen3's enable_thinking, gpt-oss's reasoning effort "
                        "high / low); default: the template's own")
    add_model_arguments(p)


def run(args) -> int:
    s = call_with_flags(regenerate, args)
    print(
        f"{s['out']}: {s['written']} responses written, {s['skipped']} already there, "
        f"{s['finished']} of the new ones ended at eos ({s['prompts']} prompts)"
        + (f"; {s['unsplit']} gpt-oss replies were not analysis / final channels or a function call and were kept as "
           "text"
           if s.get("unsplit") else "")
    )
    return 0
