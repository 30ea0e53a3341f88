"""CSV exports: a cell a spreadsheet would run as a formula is escaped; numbers stay numbers."""

import csv
import io

from specplay.app.export import runs_csv


def read_back(records):
    return list(csv.DictReader(io.StringIO(runs_csv(records))))


def test_cells_that_would_start_a_formula_get_a_leading_quote():
    record = {"method": "=HYPERLINK(\"http://x\",\"y\")", "prompt": "+cmd|' /C calc'!A0", "text": "-1+2",
              "model_id": "@SUM(A1:A9)", "draft": {"id": "\t=1"}, "stop_reason": "eos"}
    row = read_back([record])[0]
    assert row["method"] == "'=HYPERLINK(\"http://x\",\"y\")"
    assert row["prompt"] == "'+cmd|' /C calc'!A0"
    assert row["text"] == "'-1+2"
    assert row["model_id"] == "'@SUM(A1:A9)"
    assert row["draft_id"] == "'\t=1"
    assert row["stop_reason"] == "eos"  # other text as it was


def test_negative_numbers_stay_numbers():
    record = {"method": "m", "tokens_per_s": -1.5, "speedup": -2, "seed": -7, "mean_accepted": -1e-3,
              "text": "-3.25", "prompt": "+4"}
    row = read_back([record])[0]
    assert (row["tokens_per_s"], row["speedup"], row["seed"], row["mean_accepted"]) == ("-1.5", "-2", "-7", "-0.001")
    assert float(row["tokens_per_s"]) == -1.5
    assert row["text"] == "-3.25" and row["prompt"] == "+4"  # text that is only a number runs nothing


def test_a_carriage_return_in_a_cell_keeps_the_row_whole():
    rows = read_back([{"method": "m", "text": "one\rtwo", "prompt": "\r=1"}, {"method": "n", "text": "three"}])
    assert [(r["method"], r["text"]) for r in rows] == [("m", "one\rtwo"), ("n", "three")]
    assert rows[0]["prompt"] == "'\r=1"
