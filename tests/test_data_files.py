"""Data files as users bring them: headerless TSVs, RFC 4180 CSVs with line breaks in quoted
fields, fields longer than the csv module's 128 KB default, one-label files, another task's file
given to `attnlab eval`, and `--data DIR` with the usual split names."""
from __future__ import annotations

import csv
from pathlib import Path

import pytest

from attnlab.cli import main
from attnlab.data.labelled import read_labelled
from attnlab.data.text import text_file_corpus

TINY_CLS = ["--steps", "2", "--d-model", "16", "--heads", "2", "--layers", "1", "--no-progress"]
TINY_TR = ["--tokenizer", "word", "--steps", "2", "--eval-every", "2", "--d-model", "16", "--heads", "2",
           "--layers", "1", "--d-ff", "32", "--max-tokens", "256", "--eval-size", "2", "--no-progress"]
NEWS = [("stocks fell as markets closed", "3"), ("the team won the final", "2"), ("a new phone was released", "4"),
        ("leaders met for peace talks", "1")]


def _cli(capsys, *args) -> tuple[int, str]:
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_a_headerless_four_class_tsv_is_data_from_its_first_line(tmp_path):
    f = tmp_path / "ag.tsv"
    f.write_text("".join(f"{t}\t{y}\n" for t, y in NEWS * 3))
    ex = read_labelled(f)
    assert ex.texts[0] == NEWS[0][0] and ex.labels[:4] == ["3", "2", "4", "1"] and len(ex) == 12
    assert ex.lines[0] == 1 and "no header line" in ex.layout and "column 2 is the label" in ex.layout


def test_a_first_line_is_a_header_only_if_it_names_a_column(tmp_path):
    f = tmp_path / "named.tsv"
    f.write_text("body\tstars\n" + "".join(f"{t}\t{y}\n" for t, y in NEWS))
    ex = read_labelled(f, text_column="body", label_column="stars")
    assert len(ex) == 4 and "header line" in ex.layout
    unnamed = read_labelled(f)                      # body/stars name no known column: data, the label has 5 values
    assert len(unnamed) == 5 and unnamed.labels[0] == "stars"
    numbered = read_labelled(f, text_column="1", label_column="2")
    assert numbered.texts == unnamed.texts


def test_headerless_label_column_is_the_one_with_fewest_values_and_other_columns_join(tmp_path):
    f = tmp_path / "ag.csv"
    f.write_text("".join(f'"{y}","title {i}","{t}"\n' for i, (t, y) in enumerate(NEWS * 2)))
    ex = read_labelled(f)                           # four labels and four texts: the shorter column is the label
    assert ex.labels[:4] == ["3", "2", "4", "1"] and ex.texts[0] == f"title 0 {NEWS[0][0]}"


def test_a_quoted_csv_field_may_hold_line_breaks_and_lines_name_the_record_start(tmp_path):
    f = tmp_path / "multi.csv"
    with open(f, "w", newline="") as out:
        w = csv.writer(out)
        w.writerow(["text", "label"])
        w.writerow(["first line\nsecond line, with a comma", "pos"])
        w.writerow(["plain", "neg"])
        w.writerow(["bad row"])
    with pytest.raises(ValueError, match=r"multi.csv, line 5: 1 fields, but the header names 2"):
        read_labelled(f)
    ex = read_labelled(f, skip_malformed=True)
    assert ex.texts == ["first line\nsecond line, with a comma", "plain"] and ex.lines == [2, 4] and ex.skipped == 1


@pytest.mark.parametrize("suffix", [".csv", ".tsv"])
def test_a_field_over_128_kb_is_read_and_the_csv_limit_is_restored(tmp_path, suffix):
    big = "word " * 40_000                          # 200 KB
    sep = "," if suffix == ".csv" else "\t"
    f = tmp_path / f"big{suffix}"
    f.write_text(f"text{sep}label\n{big.strip()}{sep}pos\nshort{sep}neg\n")
    before = csv.field_size_limit()
    ex = read_labelled(f)
    assert len(ex.texts[0]) == len(big.strip()) and ex.labels == ["pos", "neg"]
    assert csv.field_size_limit() == before


def test_the_data_shapes_users_bring_all_train(tmp_path, capsys):
    (tmp_path / "ag.tsv").write_text("".join(f"{t}\t{y}\n" for t, y in NEWS * 4))
    with open(tmp_path / "multi.csv", "w", newline="") as out:
        csv.writer(out).writerows([["text", "label"]] + [[f"{t}\nmore", y] for t, y in NEWS * 4])
    rows = "".join(f"{t},{y}\n" for t, y in NEWS * 4)
    (tmp_path / "big.csv").write_text("text,label\n" + "x" * 140_000 + ",1\n" + rows)
    for name in ("ag.tsv", "multi.csv", "big.csv"):
        code, out = _cli(capsys, "train", "classify", "--data", tmp_path / name, "--out", tmp_path / name[:3],
                         *TINY_CLS)
        assert code == 0, out
        assert "labels: 1, 2, 3, 4" in out
    assert "no header line" in _cli(capsys, "eval", tmp_path / "ag.", "--data", tmp_path / "ag.tsv")[1]


def test_a_classification_file_with_one_label_is_refused(tmp_path, capsys):
    f = tmp_path / "one.tsv"
    f.write_text("text\tlabel\n" + "a film\tpos\n" * 5)
    code, out = _cli(capsys, "train", "classify", "--data", f, "--out", tmp_path / "r", *TINY_CLS)
    assert code == 2 and "every one of its 5 examples has the label 'pos'" in out and "two labels or more" in out


def test_eval_names_the_task_whose_file_it_was_given(tmp_path, capsys):
    pairs = tmp_path / "pairs.tsv"
    pairs.write_text("".join(f"{a} cat\tcat {a}\n" for a in ("one", "two", "three", "four")) * 3)
    labelled = tmp_path / "labelled.tsv"
    labelled.write_text("sentence\tlabel\n" + "".join(f"{t}\t{y}\n" for t, y in NEWS * 50))
    code, out = _cli(capsys, "train", "translate", "--data", pairs, "--valid", pairs, "--out", tmp_path / "tr",
                     *TINY_TR)
    assert code == 0, out
    code, out = _cli(capsys, "eval", tmp_path / "tr", "--data", labelled)
    assert code == 2 and "labelled texts (a header line naming the columns sentence, label)" in out
    assert "which a classify run reads" in out and "BLEU" not in out
    assert _cli(capsys, "train", "classify", "--data", labelled, "--out", tmp_path / "cls", *TINY_CLS)[0] == 0
    code, out = _cli(capsys, "eval", tmp_path / "cls", "--data", pairs)
    assert code == 2 and "sentence pairs" in out and "which a translation run reads" in out
    (tmp_path / "text.txt").write_text("the cat sat on the mat. " * 50)
    assert _cli(capsys, "train", "lm", "--data", tmp_path / "text.txt", "--out", tmp_path / "lm", "--steps", "2",
                "--d-model", "16", "--heads", "2", "--layers", "1", "--context", "16", "--batch-size", "2",
                "--sample-tokens", "0", "--no-progress")[0] == 0
    code, out = _cli(capsys, "eval", tmp_path / "lm", "--data", labelled)
    assert code == 2 and "which a classify run reads" in out and "a language model scores a plain text file" in out


@pytest.mark.parametrize("content, cause", [
    ("source\ttarget\n", "1 sentence pair: too few to hold out validation pairs and train"),
    ("x" * 10_000_000 + "\ty\n", "1 sentence pair: too few to hold out validation pairs and train"),
])
def test_no_training_pairs_names_the_file_and_the_cause(tmp_path, capsys, content, cause):
    f = tmp_path / "data.tsv"
    f.write_text(content)
    code, out = _cli(capsys, "train", "translate", "--data", f, "--out", tmp_path / "r", *TINY_TR)
    assert code == 2 and f"{f}: {cause}" in out, out


def test_no_training_pair_within_max_len_names_the_file_and_the_lengths(tmp_path, capsys):
    f = tmp_path / "long.tsv"
    f.write_text("".join(f"{'w ' * 30}{i}\t{'v ' * 30}{i}\n" for i in range(6)))
    code, out = _cli(capsys, "train", "translate", "--data", f, "--valid", f, "--max-len", "8", "--out", tmp_path / "r",
                     *TINY_TR)
    assert code == 2 and f"{f}: every one of its 6 training pairs is longer than --max-len 8 tokens" in out, out


def test_describe_file_names_each_layout(tmp_path):
    from attnlab.data.sniff import describe_file
    files = {"a.tsv": ("text\tlabel\ngood\tpos\n", "labelled"), "b.tsv": ("ein hund\ta dog\n", "pairs"),
             "c.jsonl": ('{"text": "good", "label": "pos"}\n', "jsonl"), "d.txt": ("just some text\n", "text"),
             "e.tsv": ("".join(f"{t}\t{y}\n" for t, y in NEWS * 4), "labelled")}
    for name, (content, kind) in files.items():
        (tmp_path / name).write_text(content)
        assert describe_file(tmp_path / name).kind == kind, name


def test_a_directory_gives_its_usual_split_files(tmp_path):
    from attnlab.data.sniff import data_directory, split_files
    (tmp_path / "train.de-en.tsv").write_text("a\tb\n")
    (tmp_path / "dev.tsv").write_text("a\tb\n")
    (tmp_path / "test.tsv").write_text("a\tb\n")
    (tmp_path / "notes.md").write_text("")
    assert split_files(tmp_path, (".tsv",)) == {"train": str(tmp_path / "train.de-en.tsv"),
                                                "valid": str(tmp_path / "dev.tsv"), "test": str(tmp_path / "test.tsv")}
    assert data_directory(str(tmp_path), None, (".tsv",)) == (str(tmp_path / "train.de-en.tsv"),
                                                              str(tmp_path / "dev.tsv"))
    assert data_directory(str(tmp_path), "mine.tsv", (".tsv",))[1] == "mine.tsv"
    (tmp_path / "train.tsv").write_text("a\tb\n")
    with pytest.raises(ValueError, match=r"2 train files \(train.de-en.tsv, train.tsv\)"):
        split_files(tmp_path, (".tsv",))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="a directory without a training file"):
        split_files(empty, (".tsv",))


def test_train_classify_and_lm_take_a_directory_and_say_which_files(tmp_path, capsys):
    d = tmp_path / "news"
    d.mkdir()
    (d / "train.tsv").write_text("".join(f"{t}\t{y}\n" for t, y in NEWS * 5))
    (d / "dev.tsv").write_text("".join(f"{t}\t{y}\n" for t, y in NEWS))
    code, out = _cli(capsys, "train", "classify", "--data", d, "--out", tmp_path / "r", *TINY_CLS)
    assert code == 0 and f"data: {d / 'train.tsv'}: 20 training texts, 4 validation" in out, out
    assert f"{d / 'dev.tsv'}: no header line" in out
    assert "train.tsv" in (tmp_path / "r" / "config.yaml").read_text()
    # the same directory again on --resume is the same data; another one is not
    code, out = _cli(capsys, "train", "classify", "--resume", "--data", d, "--out", tmp_path / "r", "--steps", "3",
                     "--no-progress")
    assert code == 0, out
    other = tmp_path / "other"
    other.mkdir()
    (other / "train.tsv").write_text((d / "train.tsv").read_text())
    code, out = _cli(capsys, "train", "classify", "--resume", "--data", other, "--out", tmp_path / "r", "--steps", "4")
    assert code == 2 and "--data" in out and "differs from the run's" in out, out
    books = tmp_path / "books"
    books.mkdir()
    for i in range(3):
        (books / f"book{i}.txt").write_text(f"book {i}: the cat sat on the mat. " * 20)
    (books / "valid.txt").write_text("the dog sat on the mat. " * 20)
    corpus = text_file_corpus(str(books))
    assert corpus.train_names == ["book0.txt", "book1.txt", "book2.txt"] and corpus.valid_names == ["valid.txt"]
    code, out = _cli(capsys, "train", "lm", "--data", books, "--out", tmp_path / "lm", "--steps", "2", "--d-model",
                     "16", "--heads", "2", "--layers", "1", "--context", "16", "--batch-size", "2", "--sample-tokens",
                     "0", "--no-progress")
    assert code == 0 and "3 training file(s) (book0.txt, book1.txt, book2.txt), validation valid.txt" in out, out
