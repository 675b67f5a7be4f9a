"""Dataset formats, the assistant loss mask under the real chat template, deterministic splits, and regeneration."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import make_tiny_target

from dspark_hf.corpora import chatterbot_conversations, chitchat_conversations
from dspark_hf.data import read_jsonl, split_conversations, split_of, write_jsonl
from dspark_hf.tokenization import tokenize_conversation, tokenize_conversations
from dspark_hf.regenerate import _rows_can_leave, _sampling, generate_batch, length_groups, regenerate_conversations

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Tell me a joke about cats."},
    {"role": "assistant", "content": "Cats don't tell jokes; they just purr at yours."},
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def tiny(tokenizer):
    return make_tiny_target("llama", vocab_size=len(tokenizer), layers=2)


def test_openai_and_sharegpt_read_the_same(tmp_path):
    path = tmp_path / "mixed.jsonl"
    sharegpt = {"id": "b", "conversations": [{"from": {"system": "system", "user": "human", "assistant": "gpt"}[m["role"]],
                                              "value": m["content"]} for m in CHAT]}
    path.write_text(json.dumps({"id": "a", "messages": CHAT}) + "\n\n" + json.dumps(sharegpt) + "\n")
    a, b = read_jsonl(path)
    assert a == {"id": "a", "messages": CHAT} and b["messages"] == CHAT
    write_jsonl(tmp_path / "out.jsonl", [a, b])
    assert read_jsonl(tmp_path / "out.jsonl") == [a, {"id": "b", "messages": CHAT}]


def test_records_without_id_get_a_stable_content_id(tmp_path):
    path = tmp_path / "noid.jsonl"
    path.write_text(json.dumps({"messages": CHAT}) + "\n")
    assert read_jsonl(path)[0]["id"] == read_jsonl(path)[0]["id"] != ""


def test_unknown_format_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": CHAT}) + "\n" + json.dumps({"prompt": "x", "completion": "y"}) + "\n")
    with pytest.raises(ValueError, match=rf"{path.name}:2: unknown record format"):
        read_jsonl(path)
    path.write_text("{not json\n")
    with pytest.raises(ValueError, match=rf"{path.name}:1: not valid JSON"):
        read_jsonl(path)
    path.write_text(json.dumps({"conversations": [{"from": "robot", "value": "x"}]}) + "\n")
    with pytest.raises(ValueError, match=rf"{path.name}:1: unknown ShareGPT speaker 'robot'"):
        read_jsonl(path)


def test_loss_mask_is_exactly_the_assistant_tokens(tokenizer):
    sample = tokenize_conversation(tokenizer, CHAT)
    ids, mask = sample["input_ids"], sample["loss_mask"]
    assert ids.dtype == torch.int64 and mask.dtype == torch.uint8
    assert ids.tolist() == tokenizer.apply_chat_template(CHAT, tokenize=True)["input_ids"]
    # contiguous runs of 1s, decoded, are each reply followed by its end-of-turn token — nothing else
    runs, current = [], []
    for token, bit in zip(ids.tolist(), mask.tolist()):
        if bit:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    runs += [current] if current else []
    replies = [m["content"] for m in CHAT if m["role"] == "assistant"]
    assert [tokenizer.decode(r) for r in runs] == [r + "<|im_end|>" for r in replies]
    # everything before the first reply (system, user, "assistant\n" header) is prompt
    header = tokenizer.apply_chat_template(CHAT[:2], tokenize=True, add_generation_prompt=True)["input_ids"]
    assert mask[: len(header)].sum() == 0 and mask[len(header)] == 1


def test_loss_mask_on_real_corpora(tokenizer):
    convs = chatterbot_conversations()[:20] + chitchat_conversations()[:5]
    for conv, sample in zip(convs, tokenize_conversations(tokenizer, convs)):
        n_assistant = sum(m["role"] == "assistant" for m in conv["messages"])
        assert int((sample["input_ids"][sample["loss_mask"].bool()] == tokenizer.convert_tokens_to_ids("<|im_end|>")).sum()) == n_assistant
    truncated = tokenize_conversation(tokenizer, CHAT, max_length=10)
    assert truncated["input_ids"].shape == truncated["loss_mask"].shape == (10,)


def test_bad_datasets_and_tokenizers(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="is empty"):
        tokenize_conversations(tokenizer, [])
    with pytest.raises(ValueError, match="no assistant turns.*dspark-hf regenerate"):
        tokenize_conversations(tokenizer, [{"id": "u", "messages": [{"role": "user", "content": "hi"}]}])
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        tokenize_conversation(plain, CHAT)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        tokenize_conversations(tokenizer, read_jsonl(empty))


def test_corpora_convert_human_turns_to_prompts():
    chitchat = chitchat_conversations()
    chatterbot = chatterbot_conversations()
    assert len(chitchat) > 7000 and len(chatterbot) > 2000
    for conv in chitchat[:50] + chatterbot[:50]:
        roles = [m["role"] for m in conv["messages"]]
        assert roles[0] == "user" and all(a != b for a, b in zip(roles, roles[1:]))  # alternating, user first
    assert len({c["id"] for c in chitchat}) == len(chitchat)


def test_split_is_deterministic_disjoint_and_stable():
    convs = chatterbot_conversations()
    splits = split_conversations(convs, validation=0.1, test=0.1)
    ids = {name: {c["id"] for c in part} for name, part in splits.items()}
    assert not (ids["train"] & ids["test"]) and not (ids["train"] & ids["validation"]) and not (ids["validation"] & ids["test"])
    assert sum(map(len, ids.values())) == len(convs)
    assert 0.05 < len(ids["test"]) / len(convs) < 0.15
    again = split_conversations(list(reversed(convs))[:500], validation=0.1, test=0.1)  # reordered subset
    assert all(split_of(c["id"], 0.1, 0.1) == "test" for c in again["test"]) and {c["id"] for c in again["test"]} <= ids["test"]


def test_regenerate_writes_the_target_answers_and_resumes(tiny, tokenizer, tmp_path):
    convs = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"Question number {i}?"},
                                           {"role": "assistant", "content": "a human answer"},
                                           {"role": "user", "content": "And then?"}]} for i in range(5)]
    out = tmp_path / "regen.jsonl"
    assert regenerate_conversations(tiny, tokenizer, convs[:2], out, max_new_tokens=4, batch_size=2, progress=False) == 2
    with open(out, "a") as handle:
        handle.write('{"id": "c2", "messages": [{"role": "us')  # a kill in the middle of a line
    assert regenerate_conversations(tiny, tokenizer, convs, out, max_new_tokens=4, batch_size=2, progress=False) == 3
    records = read_jsonl(out)
    assert [r["id"] for r in records] == ["c0", "c1", "c2", "c3", "c4"]
    for record, conv in zip(records, convs):
        roles = [m["role"] for m in record["messages"]]
        assert roles == ["user", "assistant", "user", "assistant"]
        assert [m["content"] for m in record["messages"] if m["role"] == "user"] == ["Question number " + conv["id"][1:] + "?", "And then?"]
        assert all(m["content"] != "a human answer" for m in record["messages"])
    # greedy regeneration is exactly what the target writes alone
    prompt = tokenizer.apply_chat_template(records[0]["messages"][:1], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    alone = tiny.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert tokenizer.decode(alone[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True).strip() == records[0]["messages"][1]["content"]
    assert regenerate_conversations(tiny, tokenizer, convs, out, progress=False) == 0  # all done


def _long_chat(n_turns: int, conv_id: str = "long") -> dict:
    messages = [{"role": "system", "content": "You are terse."}]
    for turn in range(n_turns):
        messages += [{"role": "user", "content": f"Turn {turn}: tell me one more thing about the weather, please."},
                     {"role": "assistant", "content": "a human answer"}]
    return {"id": conv_id, "messages": messages}


class _PromptRecorder:
    """Wraps `generate` to record each call's prompt length, and how many of its tokens the call had to encode."""

    def __init__(self, model, monkeypatch):
        self.prompts, self.encoded = [], []
        original = model.generate

        def generate(*args, **kwargs):
            length = kwargs["input_ids"].shape[1]
            cache = kwargs.get("cache")
            self.prompts.append(length)
            self.encoded.append(length - (cache.get_seq_length() if cache is not None else 0))
            return original(*args, **kwargs)

        monkeypatch.setattr(model, "generate", generate)


def test_regenerate_bounds_long_histories_and_reports_throughput(tiny, tokenizer, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DSPARK_HF_PROGRESS_INTERVAL", "0")  # captured stderr is no terminal: log lines, at once
    convs = [_long_chat(30)]
    recorder = _PromptRecorder(tiny, monkeypatch)
    out = tmp_path / "long.jsonl"
    assert regenerate_conversations(tiny, tokenizer, convs, out, max_new_tokens=4, max_length=160, progress=True) == 1
    record = read_jsonl(out)[0]
    roles = [m["role"] for m in record["messages"]]
    assert roles == ["system"] + ["user", "assistant"] * 30
    assert len(recorder.prompts) == 30 and max(recorder.prompts) <= 160 - 4
    # the history grew past the budget, so old turns were dropped (the prompt shrank at least once) ...
    assert any(b < a for a, b in zip(recorder.prompts, recorder.prompts[1:]))
    # ... and between drops each turn encodes only its own new tokens (the last reply and the new user turn): the KV
    # cache of the prefix is reused
    grown = [(encoded, b - a) for a, b, encoded in zip(recorder.prompts, recorder.prompts[1:], recorder.encoded[1:]) if b > a]
    assert len(grown) >= 15 and all(encoded <= growth + 4 for encoded, growth in grown)
    captured = capsys.readouterr()
    assert "30/30" in captured.err and "turn" in captured.err  # progress counts turns
    assert "regenerate: 30 replies" in captured.out and "tokens/s" in captured.out


def test_regenerate_reusing_the_cache_writes_what_fresh_prompts_write(tiny, tokenizer, tmp_path):
    convs = [_long_chat(6, "a")]
    reused = regenerate_conversations(tiny, tokenizer, convs, tmp_path / "a.jsonl", max_new_tokens=6, batch_size=1, progress=False)
    fresh_convs = convs + [{"id": "pad", "messages": [{"role": "user", "content": "hi"}]}]  # a batch of 2: no cache
    fresh = regenerate_conversations(tiny, tokenizer, fresh_convs, tmp_path / "b.jsonl", max_new_tokens=6, batch_size=2, progress=False)
    assert (reused, fresh) == (1, 2)
    assert read_jsonl(tmp_path / "a.jsonl")[0] == read_jsonl(tmp_path / "b.jsonl")[0]


def test_length_groups_bound_the_padded_tokens_of_each_call():
    lengths = [30, 5, 400, 7, 6, 31, 29]
    groups = length_groups(lengths, max_batch_tokens=100)
    assert sorted(i for group in groups for i in group) == list(range(len(lengths)))
    assert all(len(group) * max(lengths[i] for i in group) <= 100 for group in groups if len(group) > 1)
    assert [2] in groups  # longer than the bound: alone
    assert groups[0] == [1, 4, 3]  # shortest first, packed
    assert length_groups(lengths, max_batch_tokens=10_000) == [sorted(range(7), key=lambda i: lengths[i])]


def test_regenerate_split_by_length_writes_what_one_batch_writes(tiny, tokenizer, tmp_path, monkeypatch):
    convs = [{"id": f"c{i}", "messages": [{"role": "user", "content": "Tell me more. " * (1 + 6 * (i % 2)) + str(i)}]}
             for i in range(4)]
    whole = regenerate_conversations(tiny, tokenizer, convs, tmp_path / "whole.jsonl", max_new_tokens=5, batch_size=4,
                                     progress=False)
    recorder = _PromptRecorder(tiny, monkeypatch)
    split = regenerate_conversations(tiny, tokenizer, convs, tmp_path / "split.jsonl", max_new_tokens=5, batch_size=4,
                                     max_batch_tokens=100, progress=False)
    assert (whole, split) == (4, 4)
    assert recorder.prompts == [36, 60, 60]  # the two short prompts (36 tokens) together, the long ones one by one
    assert read_jsonl(tmp_path / "whole.jsonl") == read_jsonl(tmp_path / "split.jsonl")


def test_finished_replies_leave_the_batch_and_the_rest_write_what_one_call_writes(smollm2, monkeypatch):
    """SmolLM2 (fp32, greedy): short and long answers in one batch, 6 tokens at a time. Rows leave the batch as their
    replies end, and every reply is the one a single generate call over the whole batch writes."""
    model, tokenizer = smollm2
    questions = ["Say only: yes.", "Say only: no.", "Name one colour, one word.", "Explain in detail how a bicycle works."]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"] for q in questions]
    settings = _sampling(30, 0.0, 1.0, tokenizer.pad_token_id)
    whole = generate_batch(model, tokenizer, prompts, settings, chunk_tokens=30)
    rows = []
    original = model.generate
    monkeypatch.setattr(model, "generate", lambda **kwargs: rows.append(kwargs["input_ids"].shape[0]) or original(**kwargs))
    chunked = generate_batch(model, tokenizer, prompts, settings, chunk_tokens=6)
    assert chunked == whole
    lengths = whole[1]
    assert min(lengths) < 6 and max(lengths) == 30  # some answers end in the first chunk, some run to the limit ...
    assert rows == [sum(n > 6 * chunk for n in lengths) for chunk in range(5)]  # ... and each call kept the rest only
    assert rows[-1] < rows[0]


def test_only_attention_caches_let_finished_rows_leave(smollm2):
    """Linear-attention layers (Qwen3-Next) carry a recurrent state that dropping key/value rows would not cut: such a
    target generates each batch in one call."""
    from transformers import DynamicCache, Qwen3NextConfig

    assert _rows_can_leave(DynamicCache(config=smollm2[0].config))
    assert not _rows_can_leave(DynamicCache(config=Qwen3NextConfig(num_hidden_layers=4)))


def test_regenerate_refuses_a_budget_without_room_for_the_reply(tiny, tokenizer, tmp_path):
    with pytest.raises(ValueError, match="--max-length 8 leaves no room.*--max-new-tokens 16"):
        regenerate_conversations(tiny, tokenizer, [_long_chat(1)], tmp_path / "x.jsonl", max_new_tokens=16, max_length=8, progress=False)


def test_regenerate_with_a_drafter_writes_what_plain_regeneration_writes(smollm2, tmp_path):
    """`regenerate --drafter`: batched speculation over real chat turns, greedy: the same replies, byte for byte."""
    from dspark_hf.corpora import chitchat_conversations
    from dspark_hf.regenerate import _load_drafter

    target, tokenizer = smollm2
    convs = [_first_user_turn(c) for c in chitchat_conversations()[:6]]
    plain = regenerate_conversations(target, tokenizer, convs, tmp_path / "plain.jsonl", max_new_tokens=24, batch_size=3,
                                     progress=False)
    drafter = _load_drafter("examples/smollm2-dspark", target)
    drafted = regenerate_conversations(target, tokenizer, convs, tmp_path / "drafted.jsonl", max_new_tokens=24,
                                       batch_size=3, progress=False, drafter=drafter)
    assert plain == drafted == 6 and drafter.last_generation_stats.rounds > 0
    assert (tmp_path / "plain.jsonl").read_text() == (tmp_path / "drafted.jsonl").read_text()


def _first_user_turn(conversation: dict) -> dict:
    return {"id": conversation["id"], "messages": conversation["messages"][:1]}


# ------------------------------------------------------------------------------------- every dataset format users have
def _sharegpt(conv: dict) -> dict:
    speaker = {"system": "system", "user": "human", "assistant": "gpt"}
    return {"id": conv["id"], "conversations": [{"from": speaker[m["role"]], "value": m["content"]} for m in conv["messages"]]}


def test_every_dataset_format_reads_the_same_conversations(tmp_path):
    import datasets

    from dspark_hf.data import load_conversations

    convs = chatterbot_conversations()[:40]
    table = datasets.Dataset.from_list(convs)
    table.to_parquet(str(tmp_path / "chat.parquet"))
    datasets.Dataset.from_list([_sharegpt(c) for c in convs]).to_parquet(str(tmp_path / "sharegpt.parquet"))
    datasets.Dataset.from_list([{"id": c["id"], "dialog": c["messages"]} for c in convs]).to_parquet(str(tmp_path / "dialog.parquet"))
    datasets.DatasetDict({"train": table, "test": table.select(range(3))}).save_to_disk(str(tmp_path / "saved"))
    for k, part in enumerate((convs[:15], convs[15:])):
        (tmp_path / "parquet-shards").mkdir(exist_ok=True)
        datasets.Dataset.from_list(part).to_parquet(str(tmp_path / "parquet-shards" / f"train-{k:05d}.parquet"))
        write_jsonl(tmp_path / "jsonl-shards" / f"part-{k}.jsonl", part)
    shutil_copy_arrow(table, tmp_path / "chat.arrow")
    for source in ("chat.parquet", "sharegpt.parquet", "saved", "parquet-shards", "jsonl-shards", "chat.arrow"):
        assert load_conversations(tmp_path / source) == convs, source
    assert load_conversations(tmp_path / "saved", hub_split="test") == convs[:3]
    assert load_conversations(tmp_path / "dialog.parquet", messages_column="dialog") == convs
    (tmp_path / "dialog.jsonl").write_text("".join(json.dumps({"id": c["id"], "dialog": c["messages"]}) + "\n" for c in convs))
    assert load_conversations(tmp_path / "dialog.jsonl", messages_column="dialog") == convs  # JSONL reads it too
    with pytest.raises(ValueError, match=r"dialog.jsonl:1: no 'turns' key \(keys: dialog, id\); pass --messages-column"):
        load_conversations(tmp_path / "dialog.jsonl", messages_column="turns")


def shutil_copy_arrow(table, path) -> None:
    """An Arrow file as `datasets` writes its own (a stream of record batches)."""
    import pyarrow as pa

    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.data.table.schema) as writer:
        writer.write_table(table.data.table)


def test_a_hub_dataset_reads_from_the_local_cache_offline(tmp_path, monkeypatch):
    """A Hub id offline: what `load_dataset` left in its cache on an earlier online run (built here by hand, with
    the layout the Hub loader reads back offline)."""
    import shutil

    import datasets

    from dspark_hf.data import load_conversations

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    convs = chatterbot_conversations()[:12]
    datasets.Dataset.from_list(convs).to_parquet(str(tmp_path / "train.parquet"))
    datasets.load_dataset("parquet", data_files=str(tmp_path / "train.parquet"), split="train", cache_dir=str(tmp_path / "cache"))
    built = next((tmp_path / "cache" / "parquet").glob("default-*/0.0.0/*/dataset_info.json")).parent
    entry = tmp_path / "cache" / "someone___tiny-chat" / "default" / "0.0.0" / built.name
    shutil.copytree(built, entry)
    for arrow in entry.glob("parquet-*.arrow"):
        arrow.rename(entry / arrow.name.replace("parquet-", "tiny-chat-"))
    assert load_conversations("someone/tiny-chat") == convs
    with pytest.raises(ValueError, match="not a file, a folder, a built-in corpus .* or a Hub dataset in the local cache"):
        load_conversations("someone/never-downloaded")


def test_dataset_problems_are_one_line(tmp_path):
    import datasets

    from dspark_hf.data import load_conversations

    datasets.Dataset.from_list([{"text": "hello"}]).to_parquet(str(tmp_path / "plain.parquet"))
    with pytest.raises(ValueError, match=r"no 'messages' or 'conversations' column \(columns: text\); pass --messages-column"):
        load_conversations(tmp_path / "plain.parquet")
    with pytest.raises(ValueError, match="no column 'turns' .*pass --messages-column with one of them"):
        load_conversations(tmp_path / "plain.parquet", messages_column="turns")
    datasets.Dataset.from_list([{"messages": [{"role": "robot", "content": "x"}]}]).to_parquet(str(tmp_path / "robot.parquet"))
    with pytest.raises(ValueError, match=r"robot.parquet row 0: unknown role 'robot'"):
        load_conversations(tmp_path / "robot.parquet")
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.jsonl").write_text("")
    (tmp_path / "mixed" / "b.parquet").write_bytes((tmp_path / "plain.parquet").read_bytes())
    with pytest.raises(ValueError, match="mixes .jsonl, .parquet files"):
        load_conversations(tmp_path / "mixed")
    for missing in ("missing.parquet", "missing.jsonl"):
        with pytest.raises(FileNotFoundError, match="does not exist; pass an existing JSONL, Parquet, .* file, a folder "
                                                    r"of them, a built-in corpus \(chitchat, .*\) or a Hub dataset id"):
            load_conversations(tmp_path / missing)
    (tmp_path / "chat.txt").write_text("hi")
    with pytest.raises(ValueError, match="unknown suffix"):
        load_conversations(tmp_path / "chat.txt")


@pytest.mark.slow
def test_cli_reads_parquet_and_names_a_bad_column(tmp_path):
    import subprocess
    import sys

    import datasets

    datasets.Dataset.from_list([{"id": "x", "turns": [{"role": "user", "content": "hi"}]}]).to_parquet(str(tmp_path / "t.parquet"))
    command = [sys.executable, "-m", "dspark_hf.cli", "regenerate", "--target", "smollm2", "--dataset",
               str(tmp_path / "t.parquet"), "--output", str(tmp_path / "out.jsonl")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "pass --messages-column NAME" in result.stderr.strip().splitlines()[-1]


def test_a_repeated_prompt_without_an_id_is_refused_naming_its_lines(tmp_path, capsys):
    """A record without an `id` is keyed by its turns, so a prompt that appears twice repeats its key: regenerate
    refuses the whole file (whatever --split and --limit pick) naming the lines, before any target loads."""
    from dspark_hf import cli

    prompts = ["What is a cat?", "Name a colour.", "What is a cat?", "Say hi.", "Name a colour."]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n" for p in prompts))
    for limit in ("1", "5"):
        assert cli.main(["regenerate", "--target", "no-such-model", "--input", str(path), "--output",
                         str(tmp_path / "out.jsonl"), "--limit", limit]) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        assert (f"2 conversations of {path} repeat an earlier one's id ({path}:3 repeats {path}:1, {path}:5 repeats "
                f"{path}:2; a record without an \"id\" is keyed by its turns)") in err, err
        assert "drop the repeats or give each record a unique \"id\"" in err and not (tmp_path / "out.jsonl").exists()


def test_the_split_shares_are_printed_and_a_small_test_split_names_the_fix(tmp_path, capsys):
    from dspark_hf.data import TEST_SHARE, VALIDATION_SHARE, load_selected_conversations
    from dspark_hf.prompts import domain_prompts, held_out_prompts

    assert VALIDATION_SHARE == TEST_SHARE == 0.02  # docs/training.md states them
    ids = [i for i in (f"c{n}" for n in range(10_000)) if split_of(i) != "test"][:100]
    path = tmp_path / "prompts.jsonl"
    write_jsonl(path, [{"id": i, "messages": [{"role": "user", "content": f"Tell me about {i}."}]} for i in ids])
    validation = sum(split_of(i) == "validation" for i in ids)
    load_selected_conversations(path, "train", need_assistant=False, log=print)
    assert capsys.readouterr().out.strip() == (f"{path}: 100 conversations, {100 - validation} train / {validation} "
                                               "validation / 0 test (the hash of each id sends 96% / 2% / 2% of them)")
    with pytest.raises(ValueError, match=r"no prompts with a user turn in the 'test' split of .*prompts.jsonl: 100 "
                                         r"conversations, .* 0 test .*; pass --split validation"):
        held_out_prompts([str(path)], "test", 8)
    with pytest.raises(ValueError, match=rf"pass --split validation or --prompts {path}:validation"):
        domain_prompts(str(path), "test", 8)
    assert len(domain_prompts(f"{path}:validation", "test", 8)) == min(validation, 8)
    if validation < 8:
        assert f"holds {validation} of the 8 prompts asked" in capsys.readouterr().err
