"""Supervised records: `setdiff preprocess --supervised` into indexed datasets, and the rows megatron's
builder serves from them (padded or packed, epoch after epoch, blended, resumable)."""

import json

import numpy as np
import pytest
import torch

from setdiff_megatron.data.preprocess import PreprocessOptions, preprocess
from setdiff_megatron.data.samples import ResumableLoader, SupervisedRows, build_datasets
from setdiff_megatron.data.supervised import RecordFields, RowFormat
from setdiff_megatron.errors import UserError

L = 32
QUIET = dict(workers=1, progress=False)
SUPERVISED = PreprocessOptions(supervised=RecordFields(), **QUIET)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_records(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def rows(prefix, tokenizer, cache, *, layout="padded", fmt=RowFormat(), num_samples=(None, None, 0), **kwargs):
    splits = build_datasets(
        [prefix],
        tokenizer,
        sequence_length=L,
        cache_dir=cache,
        split="100,0,0",
        num_samples=num_samples,
        supervised=SupervisedRows(fmt, layout),
        **kwargs,
    )
    return splits["train"]


def unpadded(sample):
    return sample["tokens"][~sample["pad_mask"]].tolist()


@pytest.fixture(scope="module")
def qa(bpe_tokenizer, tmp_path_factory):
    """40 short question/answer records, preprocessed as supervised records."""
    root = tmp_path_factory.mktemp("qa")
    records = [{"prompt": f"Q{i}: {'x' * (i % 5)}?", "response": f" A{i}" + "!" * (i % 7)} for i in range(40)]
    preprocess([write_records(root / "qa.jsonl", records)], root / "out", bpe_tokenizer, SUPERVISED)
    return root / "out" / "qa", records


def test_padded_rows_pin_the_prompt_and_pad_the_tail(bpe_tokenizer, tmp_path):
    records = [{"prompt": "Q: two plus two?", "response": " A: four."}, {"prompt": "", "response": "x" * 200}]
    (manifest,) = preprocess(
        [write_records(tmp_path / "sft.jsonl", records)], tmp_path / "out", bpe_tokenizer, SUPERVISED
    )
    assert manifest["kind"] == "supervised" and manifest["documents"] == 2
    data = rows(tmp_path / "out" / "sft", bpe_tokenizer, tmp_path / "cache", fmt=RowFormat(bos_id=bpe_tokenizer.bos_id))
    assert len(data) == 2 and data.num_truncated == 1
    first, second = sorted((data[0], data[1]), key=lambda s: int(s["pad_mask"].sum()), reverse=True)
    prompt = [bpe_tokenizer.bos_id] + bpe_tokenizer.encode(records[0]["prompt"])
    target = bpe_tokenizer.encode(records[0]["response"]) + [bpe_tokenizer.eos_id]
    used = len(prompt) + len(target)
    assert first["tokens"].tolist() == prompt + target + [bpe_tokenizer.pad_id] * (L - used)
    assert first["prompt_mask"].tolist() == [True] * len(prompt) + [False] * (L - len(prompt))
    assert first["pad_mask"].tolist() == [False] * used + [True] * (L - used)
    assert not second["pad_mask"].any() and second["prompt_mask"].sum() == 1  # BOS only; cut, no EOS
    assert second["tokens"][-1] != bpe_tokenizer.eos_id
    assert set(first) == {"tokens", "prompt_mask", "pad_mask"}


def test_bad_records_name_their_file_and_line(bpe_tokenizer, tmp_path):
    out = tmp_path / "out"
    bad = write_records(tmp_path / "bad.jsonl", [{"prompt": "p", "response": "r"}, {"prompt": "p"}])
    with pytest.raises(UserError, match=r"bad\.jsonl:2: no 'response' field"):
        preprocess([bad], out, bpe_tokenizer, SUPERVISED)
    empty = write_records(tmp_path / "empty.jsonl", [{"prompt": "p", "response": ""}])
    with pytest.raises(UserError, match=r"empty\.jsonl:1: the response \('response'\) is empty"):
        preprocess([empty], out, bpe_tokenizer, SUPERVISED)
    renamed = PreprocessOptions(supervised=RecordFields(prompt="question", response="answer"), **QUIET)
    with pytest.raises(UserError, match=r"empty\.jsonl:1: no 'question' field"):
        preprocess([empty], out, bpe_tokenizer, renamed)
    long = tmp_path / "long.jsonl"
    long.write_text(
        json.dumps({"prompt": "a", "response": "b"})
        + "\n\n"
        + json.dumps({"prompt": "word " * 100, "response": "r"})
        + "\n"
    )
    preprocess([long], out, bpe_tokenizer, SUPERVISED)
    with pytest.raises(UserError, match=r"long\.jsonl:3: the prompt \(\d+ tokens\) fills all 32 positions"):
        rows(out / "long", bpe_tokenizer, tmp_path / "cache")
    assert len(rows(out / "long", bpe_tokenizer, tmp_path / "cache2", fmt=RowFormat(max_prompt_tokens=20))) == 2
    with pytest.raises(UserError, match="holds supervised data, not pretraining"):
        build_datasets([out / "long"], bpe_tokenizer, sequence_length=L, cache_dir=tmp_path / "c", split="100,0,0")


def test_pretraining_datasets_are_refused_as_supervised(qa, bpe_tokenizer, tmp_path):
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"text": "a document"}) + "\n")
    preprocess([docs], tmp_path / "out", bpe_tokenizer, PreprocessOptions(**QUIET))
    with pytest.raises(UserError, match="holds pretraining data, not supervised.*--supervised"):
        rows(tmp_path / "out" / "docs", bpe_tokenizer, tmp_path / "cache")


@pytest.fixture(scope="module")
def chat_tokenizer(bpe_tokenizer, tmp_path_factory):
    """The test BPE with Qwen-style chat markup as special tokens and a chat template."""
    import tokenizers

    from setdiff_megatron.data.tokenizers import load_tokenizer

    directory = tmp_path_factory.mktemp("chat-tokenizer")
    bpe_tokenizer.save(directory)
    backend = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    backend.add_special_tokens(
        [tokenizers.AddedToken(t, special=True, normalized=False) for t in ("<|im_start|>", "<|im_end|>")]
    )
    backend.save(str(directory / "tokenizer.json"))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return load_tokenizer(directory)


def test_chat_records_split_at_the_last_assistant_turn(chat_tokenizer, bpe_tokenizer, tmp_path):
    from setdiff_megatron.data.chat import render_chat

    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "Four."}]
    path = write_records(tmp_path / "chat.jsonl", [{"messages": messages}])
    options = PreprocessOptions(supervised=RecordFields(messages="messages"), **QUIET)
    preprocess([path], tmp_path / "out", chat_tokenizer, options)
    (row,) = [rows(tmp_path / "out" / "chat", chat_tokenizer, tmp_path / "cache")[0]]
    context = render_chat(CHAT_TEMPLATE, messages[:-1], add_generation_prompt=True)
    assert context.endswith("<|im_start|>assistant\n")
    prompt = chat_tokenizer.encode_markup(context)
    response = chat_tokenizer.encode_markup("Four.<|im_end|>\n") + [chat_tokenizer.eos_id]
    im_start = chat_tokenizer.encode_markup("<|im_start|>")
    assert len(im_start) == 1 and prompt.count(im_start[0]) == 2  # markup as the special token itself
    assert unpadded(row) == prompt + response
    assert row["prompt_mask"].sum() == len(prompt)
    # The user's text is still text: a literal "<|im_start|>" in a plain prompt stays characters.
    assert im_start[0] not in chat_tokenizer.encode("<|im_start|>")

    not_last = write_records(tmp_path / "user-last.jsonl", [{"messages": messages[:1]}])
    with pytest.raises(UserError, match=r"user-last\.jsonl:1: the last turn of 'messages' must be the assistant"):
        preprocess([not_last], tmp_path / "out", chat_tokenizer, options)
    with pytest.raises(UserError, match="has no chat template"):
        preprocess([path], tmp_path / "plain", bpe_tokenizer, options)


def test_parquet_and_datasets_inputs_give_the_jsonl_rows(qa, bpe_tokenizer, tmp_path):
    datasets = pytest.importorskip("datasets")
    prefix, records = qa
    table = datasets.Dataset.from_list([{"question": r["prompt"], "answer": r["response"]} for r in records])
    table.save_to_disk(str(tmp_path / "qa_arrow"))
    table.to_parquet(str(tmp_path / "qa_parquet.parquet"))
    options = PreprocessOptions(
        supervised=RecordFields(prompt="question", response="answer"), workers=2, batch_bytes=64, progress=False
    )  # records in small batches over 2 processes
    preprocess([tmp_path / "qa_arrow", tmp_path / "qa_parquet.parquet"], tmp_path / "out", bpe_tokenizer, options)
    want = rows(prefix, bpe_tokenizer, tmp_path / "c0")
    for name in ("qa_arrow", "qa_parquet"):
        got = rows(tmp_path / "out" / name, bpe_tokenizer, tmp_path / f"c-{name}")
        assert [unpadded(got[i]) for i in range(len(got))] == [unpadded(want[i]) for i in range(len(want))]


def test_packed_rows_hold_whole_records_as_their_padded_rows(qa, bpe_tokenizer, tmp_path):
    prefix, records = qa
    padded = rows(prefix, bpe_tokenizer, tmp_path / "a", seed=3)
    packed = rows(prefix, bpe_tokenizer, tmp_path / "b", layout="packed", seed=3)
    assert len(padded) == len(records) and 1 < len(packed) <= 0.6 * len(records)
    # Epoch 0 visits the records in the same shuffled order under both layouts.
    expected = [unpadded(padded[i]) for i in range(len(padded))]
    got, prompts = [], []
    for i in range(len(packed)):
        row = packed[i]
        docs, pos, real = row["document_ids"], row["position_ids"], ~row["pad_mask"]
        assert bool(real[: int(real.sum())].all())  # padding only at the row's end
        for d in range(int(docs[real].max()) + 1):
            mine = real & (docs == d)
            assert pos[mine].tolist() == list(range(int(mine.sum())))
            got.append(row["tokens"][mine].tolist())
            prompts.append(int((row["prompt_mask"] & mine).sum()))
    assert got == expected
    assert prompts == [int(padded[i]["prompt_mask"].sum()) for i in range(len(padded))]


def test_epochs_reshuffle_and_a_resume_mid_epoch_continues_exactly(qa, bpe_tokenizer, tmp_path):
    prefix, records = qa
    data = rows(prefix, bpe_tokenizer, tmp_path, num_samples=(100, None, 0))
    assert len(data) == 100
    seen = [tuple(unpadded(data[i])) for i in range(100)]
    first, second = seen[:40], seen[40:80]
    assert len(set(first)) == 40 and set(first) == set(second) and first != second
    loader = ResumableLoader(data, micro_batch_size=4)
    batches = iter(loader)
    for _ in range(13):  # 52 rows: in the second epoch
        next(batches)
    resumed = ResumableLoader(data, micro_batch_size=4)
    resumed.load_state_dict(loader.state_dict())
    assert torch.equal(next(iter(resumed))["tokens"], next(batches)["tokens"])


def test_blends_mix_supervised_datasets_by_weight(bpe_tokenizer, tmp_path):
    a = write_records(tmp_path / "a.jsonl", [{"prompt": "a", "response": "aaaa"}] * 30)
    b = write_records(tmp_path / "b.jsonl", [{"prompt": "b", "response": "bbbb"}] * 30)
    preprocess([a, b], tmp_path / "out", bpe_tokenizer, SUPERVISED)
    blend = build_datasets(
        [tmp_path / "out" / "a", tmp_path / "out" / "b"],
        bpe_tokenizer,
        sequence_length=L,
        cache_dir=tmp_path / "cache",
        split="90,10,0",
        weights=[0.75, 0.25],
        num_samples=(4000, 20, 0),
        supervised=SupervisedRows(RowFormat()),
    )
    train = blend["train"]
    a_id = bpe_tokenizer.encode("a")[0]
    share = np.mean([int(train[i]["tokens"][0]) == a_id for i in range(len(train))])
    assert len(train) == 4000 and abs(share - 0.75) < 0.02
    assert len(blend["valid"]) == 20


def test_row_format_cuts_and_marks(bpe_tokenizer):
    eos, bos = bpe_tokenizer.eos_id, bpe_tokenizer.bos_id
    fmt = RowFormat(bos_id=bos, prompt_eos_id=eos, max_prompt_tokens=5, max_response_tokens=4, force_eos=True)
    assert fmt.prompt([7, 8, 9, 10, 11]).tolist() == [bos, 7, 8, 9, eos]
    stored = np.array([2, 9])
    assert fmt.prompt_lengths(stored).tolist() == [4, 5]
    assert fmt.response_lengths(np.array([3, 10]), np.array([20, 2])).tolist() == [3, 2]
    assert fmt.response(np.array([1, 2, 3, 4, 5, eos]), 4, eos).tolist() == [1, 2, 3, eos]
    assert RowFormat().response(np.array([1, 2, 3, eos]), 2, eos).tolist() == [1, 2]  # cut, not forced


def test_evaluation_prompts_are_formatted_as_training_rows_began(chat_tokenizer, tmp_path):
    """`setdiff eval generate` / `setdiff sample` prompts (inference/prompts.py): a chat's
    generation prompt is exactly a trained record's pinned context, and a text prompt gets the
    rows' BOS, prompt EOS and cut."""
    from setdiff_megatron.data.chat import split_conversation
    from setdiff_megatron.inference.prompts import encode_prompt, read_prompts

    turns = [{"role": "user", "content": "2+2?"}]
    path = write_records(tmp_path / "p.jsonl", [{"messages": turns}, {"prompt": "a long prompt text"}])
    chat, text = read_prompts(path)
    context, _ = split_conversation(CHAT_TEMPLATE, [*turns, {"role": "assistant", "content": "Four."}])
    assert encode_prompt(chat, chat_tokenizer, RowFormat()) == chat_tokenizer.encode_markup(context)
    tok = chat_tokenizer
    fmt = RowFormat(bos_id=tok.bos_id, prompt_eos_id=tok.eos_id, max_prompt_tokens=4)
    assert encode_prompt(text, tok, fmt) == [tok.bos_id, *tok.encode("a long prompt text")[:2], tok.eos_id]
    bad = write_records(tmp_path / "bad.jsonl", [{"messages": [{"role": "user"}]}])
    with pytest.raises(UserError, match=r"bad\.jsonl:1: turn 0 of 'messages' needs a string 'role' and a string"):
        read_prompts(bad)
