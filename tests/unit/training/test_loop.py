"""`fe_megatron.training.loop`: a start drops the metrics records it writes again."""

import json


def test_keep_records_up_to_drops_what_a_start_writes_again(tmp_path):
    from fe_megatron.training.loop import keep_records_up_to

    path = tmp_path / "metrics.jsonl"
    records = [{"event": "start", "start_step": 0}, {"step": 2}, {"step": 4, "val_loss": 1.0}, {"step": 6},
               {"event": "start", "start_step": 4}, {"step": 6}, {"event": "final", "step": 8}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 7, "lm_lo')  # a cut last line
    assert keep_records_up_to(str(path), 4) == 5
    assert [json.loads(line) for line in path.read_text().splitlines()] == records[:3]
    assert keep_records_up_to(str(path), 0) == 3 and keep_records_up_to(str(tmp_path / "none"), 0) == 0
