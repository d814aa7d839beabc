"""OUT/metrics.jsonl across a resume: the records up to the resumed step stay, a torn last line (a run killed
mid-write) is dropped with one line on stderr, and any other damaged line is an error naming the file and line."""
import json

import pytest

from dflash_fast.train.metrics import MetricsLog


def write_metrics(out, lines):
    path = out / "metrics.jsonl"
    path.write_text("".join(lines))
    return path


def record(step):
    return json.dumps({"split": "train", "step": step, "loss": 1.0 / step}) + "\n"


def test_a_resume_keeps_the_records_up_to_its_step(tmp_path):
    path = write_metrics(tmp_path, [record(1), record(2), record(3)])
    MetricsLog(str(tmp_path), 2, tensorboard=False, writer=True).record(json.loads(record(3)))
    assert path.read_text() == record(1) + record(2) + record(3)


def test_a_torn_last_line_is_dropped_saying_so_on_stderr(tmp_path, capsys):
    path = write_metrics(tmp_path, [record(1), record(2), record(3)[:17]])
    log = MetricsLog(str(tmp_path), 2, tensorboard=False, writer=True)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and str(path) in err[0] and "torn last line 3" in err[0]
    log.record(json.loads(record(3)))
    assert path.read_text() == record(1) + record(2) + record(3)


def test_a_complete_last_record_without_its_newline_gets_one_before_the_next(tmp_path):
    path = write_metrics(tmp_path, [record(1), record(2).rstrip("\n")])
    MetricsLog(str(tmp_path), 2, tensorboard=False, writer=True).record(json.loads(record(3)))
    assert path.read_text() == record(1) + record(2) + record(3)


@pytest.mark.parametrize("damage", ["{\"split\": \"tr\n", "[1, 2]\n", "{\"split\": \"train\"}\n"],
                         ids=["torn", "not-a-record", "no-step"])
def test_a_damaged_line_before_the_last_is_an_error_naming_the_file_and_line(tmp_path, damage):
    path = write_metrics(tmp_path, [record(1), damage, record(3)])
    with pytest.raises(ValueError, match=rf"{path} line 2 is not a metrics record .*repair or delete that line"):
        MetricsLog(str(tmp_path), 3, tensorboard=False, writer=True)
    assert path.read_text() == record(1) + damage + record(3), "left as it was"


def test_a_fresh_run_starts_an_empty_file_whatever_was_there(tmp_path):
    path = write_metrics(tmp_path, [record(1), "{torn\n", record(3)])
    MetricsLog(str(tmp_path), 0, tensorboard=False, writer=True)
    assert path.read_text() == ""
