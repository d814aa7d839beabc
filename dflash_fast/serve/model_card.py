"""The model card of an export: README.md with hub-ready YAML front matter.

    the drafter's config + the checkpoint's client state (step, run config) + OUT/provenance.json of the run (when
    there) + an eval report (`dflash-fast export --card-from eval.json`)  ──▶  OUT/README.md

It says what the drafter drafts for (the target), what it is (family, layout, architecture), what it learned from
(data, loss, optimizer, schedule, steps), how to serve it in vLLM and SGLang, and, given an eval report, what it
measured. Every reader of an export (load_exported, the engines) reads config.json and the weights only.
"""
import json
import os
import re
from typing import Dict, List, Optional

from dflash_fast.drafter.config import DrafterConfig
from dflash_fast.errors import COUNT, NUMBER, MapOf, Nullable, Obj, read_mapping
from dflash_fast.serve.engines import serving_engines
from dflash_fast.serve.families import LAYOUTS
from dflash_fast.serve.layouts import ExportError

CARD = "README.md"
PROVENANCE = "provenance.json"  # a training run's record of itself (written by trackers.py), read for the card
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
# The fields of `dflash-fast eval --out` the card shows; the rest of the report is not read.
EVAL_SCHEMA = Obj({"tau": Nullable(NUMBER)},
                  optional={"tau_offline": Nullable(NUMBER), "tokens_per_s": Nullable(NUMBER),
                            "target_tokens_per_s": Nullable(NUMBER), "speedup": Nullable(NUMBER)})
# The fields of provenance.json an export carries on: the training conversations' thinking counts (trackers.py).
PROVENANCE_SCHEMA = Obj({}, optional={"data": Obj({}, optional={"thinking": Nullable(MapOf(COUNT))})})


def read_eval_report(path: str) -> Dict:
    """An eval report (`dflash-fast eval --out`), its card fields checked; ExportError naming the file and field."""
    return read_mapping(path, json.load, json.JSONDecodeError, ExportError, "JSON", "a JSON object", schema=EVAL_SCHEMA)


def read_provenance(run_dir: str) -> Optional[Dict]:
    """OUT/provenance.json of a training run (trackers.py writes it), or None for runs written before it."""
    path = os.path.join(run_dir, PROVENANCE)
    if not os.path.exists(path):
        return None
    return read_mapping(path, json.load, json.JSONDecodeError, ExportError, "JSON", "a JSON object",
                        schema=PROVENANCE_SCHEMA)


def trained_thinking(provenance: Optional[Dict]) -> Optional[Dict[str, int]]:
    """The counts of training conversations rendered with the target thinking "on" / "off" that a run's
    provenance.json records (the store's extraction.thinking); None when it records none."""
    return ((provenance or {}).get("data") or {}).get("thinking") or None


def _yaml_list(items: List[str]) -> str:
    return "".join(f"\n- {json.dumps(item)}" for item in items)


def front_matter(target: str, datasets: List[str]) -> str:
    """Hub metadata: base_model (a hub id only: a local path means nothing on the hub), tags, datasets."""
    lines = ["---"]
    if _HUB_ID.match(target or "") and not os.path.exists(target):
        lines.append(f"base_model:{_yaml_list([target])}")
    lines.append("tags:" + _yaml_list(["speculative-decoding", "dflash", "draft-model", "dflash-fast"]))
    hub_datasets = [d for d in datasets if _HUB_ID.match(d) and not os.path.exists(d)]
    if hub_datasets:
        lines.append("datasets:" + _yaml_list(hub_datasets))
    return "\n".join(lines + ["---", ""])


def _num(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _table(rows: List[tuple]) -> str:
    return "| | |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in rows)


def serving(export_dir: str, target: str, fmt: str, block_size: int, family: str = "dflash",
            drafted: Optional[int] = None) -> str:
    """The vLLM command (the method the family's serving home names, the `drafted` tokens of a block: block_size - 1
    unless given) and the SGLang one where SGLang reads the export (engines.serving_engines), as docs/export.md gives
    them; where the zlab layout would be read by SGLang, the way there."""
    layout = LAYOUTS[family]
    engines = serving_engines(fmt, family)
    tokens = block_size - 1 if drafted is None else drafted
    spec = json.dumps({"method": layout.vllm_method, "model": export_dir, "num_speculative_tokens": tokens})
    text = f"```bash\n# vLLM\nvllm serve {target} --speculative-config '{spec}'\n"
    if "sglang" in engines:
        text += (f"# SGLang\npython -m sglang.launch_server --model-path {target} --speculative-algorithm DFLASH \\\n"
                 f"    --speculative-draft-model-path {export_dir} --speculative-num-draft-tokens {block_size}\n")
    text += "```\n"
    if "sglang" in engines:
        return text
    if "sglang" in serving_engines("zlab", family) and layout.zlab_architecture:
        return text + ("\nSGLang reads the zlab layout: export it again with `dflash-fast export --format zlab` to "
                       "serve it there.\n")
    model = layout.zlab_architecture if fmt == "zlab" else layout.speculators_architecture
    runner = ", V2 model runner" if layout.vllm_v2 else ""
    return text + f"\nOnly vLLM serves {layout.short} (its {model}{runner}).\n"


# data.reasoning / extract --reasoning, as a reader of the card needs it: what the drafter learned of reasoning spans.
REASONING_LINES = {
    "train": "`train`: the assistant turns' reasoning was trained on",
    "mask": "`mask`: the reasoning stayed in the context without loss",
    "drop": "`drop`: the reasoning was removed (the template's thinking switch off)",
    None: "not recorded (a store extracted before dflash-fast recorded it; `train` unless `extract --reasoning` said "
          "otherwise)",
}


def model_card(cfg: DrafterConfig, target: str, fmt: str, export_dir: str, client: Optional[Dict] = None,
               provenance: Optional[Dict] = None, report: Optional[Dict] = None) -> str:
    """README.md of an export. `client`: the checkpoint's client state (step, run config); `provenance`: the run's
    OUT/provenance.json; `report`: an eval report. Each section without its source says so."""
    client, provenance = client or {}, provenance or {}
    run = client.get("config") or provenance.get("config") or {}
    data = provenance.get("data", {})
    sources = [d for d in (data.get("data"), data.get("jsonl"), (run.get("data") or {}).get("jsonl")) if d]
    layout = LAYOUTS[cfg.family]
    family = layout.title
    parts = [front_matter(target, sources), f"# {family} drafter for {target}\n",
             f"A block-diffusion speculative-decoding drafter trained with dflash-fast: it drafts "
             f"{cfg.block_size - 1} tokens per forward for `{target}`, which verifies them.\n",
             "## Drafter\n", _table([
                 ("target", f"`{target}`"), ("family", family), ("layout", f"`{fmt}`"),
                 ("layers", cfg.num_layers), ("block size", cfg.block_size), ("hidden size", cfg.hidden_size),
                 ("target layer ids", ", ".join(map(str, cfg.layer_ids))), ("mask token id", cfg.mask_token_id),
                 ("layer types", ", ".join(cfg.layer_types) if cfg.layer_types else "full attention"),
                 ("sliding window", f"{cfg.sliding_window} (ends at the {cfg.window_from})"
                  if cfg.sliding_window else "-"),
                 *[row for row in [layout.card_row(cfg)] if row],
             ])]
    parts.append("\n## Data and recipe\n")
    if run:
        loss, opt, sched = run.get("loss", {}), run.get("optimizer", {}), run.get("schedule", {})
        rows = [("data", ", ".join(f"`{s}`" for s in sources) or f"store `{(run.get('data') or {}).get('store')}`")]
        if data.get("data_sha256"):
            rows.append(("data sha256", f"`{data['data_sha256']}`"))
        rows.append(("reasoning", REASONING_LINES.get(data.get("reasoning"), REASONING_LINES[None])))
        thinking = trained_thinking(provenance)
        if thinking:
            rows.append(("thinking", ", ".join(f"{k} ({n} conversations)" for k, n in thinking.items())
                         + ": serve with the same setting of the chat template's thinking switch"))
        rows += [("loss", f"{client.get('loss_kind') or loss.get('kind')}, weighting {loss.get('weighting')}"),
                 ("optimizer", f"{opt.get('kind')}, lr {opt.get('lr')}"),
                 ("schedule", f"{sched.get('kind')}, warmup {sched.get('warmup_ratio')}"),
                 ("sequence length", (run.get("data") or {}).get("seq_len")),
                 ("steps", client.get("step", "-"))]
        commit = ((provenance.get("code") or {}).get("git") or {}).get("commit")
        if commit:
            rows.append(("dflash-fast commit", f"`{commit}`"))
        parts.append(_table(rows))
    else:
        parts.append("Not recorded: this export was not written from a dflash-fast checkpoint.\n")
    parts += ["\n## Serving\n", "The drafter's path is where it was exported; give its hub id once uploaded.\n\n"
              + serving(export_dir, target, fmt, cfg.block_size, cfg.family, cfg.drafted_tokens)]
    if report is not None:
        parts += ["\n## Benchmark\n", "Block speculative decoding measured by `dflash-fast eval`"
                  + (f" on {report['prompts']} prompts" if report.get("prompts") else "")
                  + (f", {report['max_new_tokens']} new tokens each" if report.get("max_new_tokens") else "")
                  + (f" ({report['engine']})" if report.get("engine") else "") + ":\n\n",
                  "| tau | tau_offline | tokens/s | target tokens/s | speedup |\n|---|---|---|---|---|\n"
                  f"| {_num(report.get('tau'))} | {_num(report.get('tau_offline'))} | "
                  f"{_num(report.get('tokens_per_s'), 1)} | {_num(report.get('target_tokens_per_s'), 1)} | "
                  f"{_num(report.get('speedup'), 2)} |\n"]
    return "\n".join(parts)
