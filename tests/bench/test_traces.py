"""Trace parsing, slicing and rescaling, and the deterministic token / block-hash expansion of prompts."""

from __future__ import annotations

import gzip
import io
import json
import random

import numpy as np
import pytest

from switchyard.bench.traces import (
    NS_MOONCAKE,
    NS_UNIQUE,
    PromptFactory,
    Trace,
    TraceRequest,
    _RowFilter,
    chunk_tokens,
    chunks_tokens,
    fill_outputs,
    has_clock,
    load_trace,
    mooncake_segments,
    pace_batch,
    parse_csv,
    parse_jsonl,
    parse_where,
    prefix_hit_bound,
    scale_time,
    scale_to_rate,
    spread_ties,
    take_slice,
)
from switchyard.ext.blockhash import block_digests, to_event_hash

MOONCAKE_ROWS = [
    {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [7, 8, 9]},  # 512 + 512 + 76
    {"timestamp": 0, "input_length": 700, "output_length": 3, "hash_ids": [7, 10]},  # 512 + 188
    {"timestamp": 1500, "input_length": 512, "output_length": 0, "hash_ids": [7]},  # exactly one block
    {"timestamp": 3000, "input_length": 300, "output_length": 2, "hash_ids": [8]},  # id 8 first, truncated
]


def _mooncake():
    return parse_jsonl(io.StringIO("\n".join(json.dumps(r) for r in MOONCAKE_ROWS) + "\n"))


def test_mooncake_segments_truncate_the_last_block():
    # 1100 = 512 + 512 + 76
    assert mooncake_segments(1100, [7, 8, 9], 0) == ((NS_MOONCAKE, 7, 512), (NS_MOONCAKE, 8, 512), (NS_MOONCAKE, 9, 76))
    # fewer ids than the input needs: a unique tail of 1100 - 512 = 588 tokens
    assert mooncake_segments(1100, [7], 4) == ((NS_MOONCAKE, 7, 512), (NS_UNIQUE, 4, 588))


def test_mooncake_parse_times_and_lengths():
    t = _mooncake()
    assert [r.arrival_s for r in t.requests] == [0.0, 0.0, 1.5, 3.0]  # ms -> s
    assert [r.num_prompt_tokens for r in t.requests] == [1100, 700, 512, 300]
    assert [r.num_output_tokens for r in t.requests] == [5, 3, 1, 2]  # 0 output -> 1 (max_tokens > 0)
    assert t.has_prefix_identity


def test_mooncake_expansion_equal_ids_give_equal_blocks():
    t = _mooncake()
    pf = PromptFactory(block_size=16, seed=3)
    toks = [pf.tokens(r) for r in t.requests]
    assert [len(x) for x in toks] == [1100, 700, 512, 300]  # lengths exact
    assert toks[0][:512] == toks[1][:512] == toks[2]  # hash_id 7 everywhere
    assert toks[0][512:1024] != toks[1][512:1024]  # ids 8 vs 10 differ
    assert toks[3] == toks[0][512:812]  # id 8 truncated to 300 is a prefix of the full block
    assert all(3 <= v < 32000 for x in toks for v in x)
    # deterministic across factories, and the seed matters
    assert PromptFactory(16, seed=3).tokens(t.requests[0]) == toks[0]
    assert PromptFactory(16, seed=4).tokens(t.requests[0]) != toks[0]


def test_prefix_hit_bound_counts_blocks_an_earlier_request_stored():
    t = _mooncake()  # hash ids [7, 8, 9] 1100 tokens, [7, 10] 700, [7] 512, [8] 300 (a different first block)
    # r0 misses all; r1 hits id 7's 32 blocks; r2 is id 7 alone, capped at (512 - 1) // 16 = 31 blocks (its last
    # token is computed); r3's chain starts with another block, so nothing
    total = 1100 + 700 + 512 + 300
    assert prefix_hit_bound(t, PromptFactory(16, seed=3)) == pytest.approx((512 + 496) / total)
    # a pooled LRU of 50 blocks: r0's 68 full blocks leave only its last 50, so id 7's front is gone and r1 hits
    # nothing; r1's 43 blocks all stay, so r2 (id 7 alone) hits r1's copy: 31 blocks
    assert prefix_hit_bound(t, PromptFactory(16, seed=3), capacity_blocks=50) == pytest.approx(496 / total)
    assert prefix_hit_bound(t, PromptFactory(16, seed=3), capacity_blocks=10_000) == pytest.approx((512 + 496) / total)


@pytest.mark.parametrize("block_size", [16, 32, 48])  # 48 does not divide 512: the unmemoized path
def test_block_hashes_match_the_workers_recipe(block_size):
    t = _mooncake()
    pf = PromptFactory(block_size=block_size, seed=1)
    for r in t.requests:
        toks = pf.tokens(r)
        want = tuple(to_event_hash(d) for d in block_digests(toks, block_size, "xxhash"))
        assert pf.block_hashes(r) == want
        assert len(want) == r.num_prompt_tokens // block_size  # 1100 // 16 = 68 full blocks, ...
    # requests 0..2 share hash_id 7 under the same (empty) parent: the memo hit it
    if block_size == 16:
        assert pf.num_hash_memo_hits >= 2


def test_azure_csv_crlf():
    raw = (
        "TIMESTAMP,ContextTokens,GeneratedTokens\r\n"
        "2023-11-16 18:15:46.6805900,374,44\r\n"
        "2023-11-16 18:15:50.9951690,396,109\r\n"
        "2023-11-16 18:16:00.0000000,0,0\r\n"
    )
    t = parse_csv(io.StringIO(raw, newline=""))
    assert [r.arrival_s for r in t.requests] == pytest.approx([0.0, 4.314579, 13.31941])  # 50.995169 - 46.68059
    assert [r.num_prompt_tokens for r in t.requests] == [374, 396, 1]
    assert [r.num_output_tokens for r in t.requests] == [44, 109, 1]
    assert not t.has_prefix_identity
    pf = PromptFactory(16)
    a, b = pf.tokens(t.requests[0]), pf.tokens(t.requests[1])
    assert len(a) == 374 and len(b) == 396 and a[:16] != b[:16]  # unique prompts


def test_load_trace_sniffs_format(tmp_path):
    p = tmp_path / "mini.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in MOONCAKE_ROWS) + "\n")
    assert len(load_trace(str(p)).requests) == 4
    q = tmp_path / "mini.csv"
    q.write_bytes(b"TIMESTAMP,ContextTokens,GeneratedTokens\r\n2023-11-16 18:15:46.6805900,374,44\r\n")
    assert load_trace(str(q)).requests[0].num_output_tokens == 44
    with pytest.raises(FileNotFoundError):
        load_trace(str(tmp_path / "missing.jsonl"))


def test_qwen_bailian_jsonl(tmp_path):
    # Qwen-Bailian's traces (ATC'25): rows with a chat_id, timestamps in seconds, 16-token hash blocks (or the file
    # name's blksz_N); a follow-up turn repeats its parent's ids, so its prompt starts with the parent's tokens
    rows = [
        {"chat_id": 159, "parent_chat_id": -1, "timestamp": 61.114, "input_length": 40, "output_length": 132,
         "type": "text", "turn": 1, "hash_ids": [1089, 1090, 1091]},
        {"chat_id": 160, "parent_chat_id": 159, "timestamp": 62.5, "input_length": 70, "output_length": 9,
         "type": "text", "turn": 2, "hash_ids": [1089, 1090, 1091, 6326, 6327]},
    ]
    text = "\n".join(json.dumps(r) for r in rows) + "\n"
    p = tmp_path / "qwen_traceA_blksz_16.jsonl"
    p.write_text(text)
    t = load_trace(str(p))
    assert [r.arrival_s for r in t.requests] == pytest.approx([0.0, 1.386])
    assert t.requests[0].segments == ((NS_MOONCAKE, 1089, 16), (NS_MOONCAKE, 1090, 16), (NS_MOONCAKE, 1091, 8))
    assert [n for _, _, n in t.requests[1].segments] == [16, 16, 16, 16, 6]
    pf = PromptFactory(block_size=16)
    a, b = pf.tokens(t.requests[0]), pf.tokens(t.requests[1])
    assert len(a) == 40 and len(b) == 70 and b[:40] == a  # the parent's truncated last block is a prefix too
    assert pf.block_hashes(t.requests[1])[:2] == pf.block_hashes(t.requests[0])  # two full shared blocks
    q = tmp_path / "qwen_coder_blksz_32.jsonl"
    q.write_text(text)
    assert [n for _, _, n in load_trace(str(q)).requests[1].segments] == [32, 32, 6]


# ACDC's offline batch jobs (SOSP'26; alibaba/ServeGen data/offline/README.md): rows in file order, no timestamp;
# content-hash jobs give hash_ids of 16-token blocks and no output_length, stat jobs the lengths and a duration
ACDC_HASH_ROWS = [
    {"request_id": 0, "type": "text", "input_length": 271, "hash_ids": list(range(17)), "img_ids": []},
    {"request_id": 1, "type": "text", "input_length": 288, "hash_ids": [*range(10), *range(17, 25)], "img_ids": []},
    {"request_id": 2, "type": "multimodal", "input_length": 446, "hash_ids": list(range(655296, 655324)),
     "img_ids": ["img_00001"]},
]
ACDC_STAT_ROWS = [
    {"request_id": 0, "type": "text", "input_length": 61, "output_length": 2370, "duration": 14000},
    {"request_id": 1, "type": "text", "input_length": 54, "output_length": 2031, "duration": 11630},
]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_acdc_batch_jobs_arrive_at_once_with_16_token_blocks(tmp_path):
    t = load_trace(_jsonl(tmp_path / "trace_a.jsonl", ACDC_HASH_ROWS))
    assert [r.arrival_s for r in t.requests] == [0.0, 0.0, 0.0] and not has_clock(t)
    assert [r.num_prompt_tokens for r in t.requests] == [271, 288, 446]
    assert [r.num_output_tokens for r in t.requests] == [0, 0, 0]  # the job does not say: fill_outputs draws them
    # the ids' count says 16 tokens each (ceil(271 / 16) = 17), not Mooncake's 512: the last block is cut short
    assert t.requests[0].segments[-1] == (NS_MOONCAKE, 16, 271 - 16 * 16)
    assert {n for _, _, n in t.requests[0].segments[:-1]} == {16}
    pf = PromptFactory(block_size=16)
    a, b = pf.tokens(t.requests[0]), pf.tokens(t.requests[1])
    assert a[:160] == b[:160] and a[160:176] != b[160:176]  # 10 shared blocks: a 160-token common prefix
    assert [r.num_prompt_tokens for r in load_trace(str(tmp_path / "trace_a.jsonl"),
                                                     where={"type": ["text"]}).requests] == [271, 288]
    s = load_trace(_jsonl(tmp_path / "trace_d.jsonl", ACDC_STAT_ROWS))
    assert [(r.arrival_s, r.num_prompt_tokens, r.num_output_tokens) for r in s.requests] == [
        (0, 61, 2370), (0, 54, 2031)]
    # the first row says which fields the file has; a row that differs is an error naming its line
    for key, rows in (("timestamp", [*ACDC_STAT_ROWS, {**ACDC_STAT_ROWS[0], "timestamp": 5}]),
                      ("output_length", [*ACDC_STAT_ROWS[:1], ACDC_HASH_ROWS[0]])):
        with pytest.raises(ValueError, match=f"line {len(rows)}: .*'{key}' field, where the first row has"):
            load_trace(_jsonl(tmp_path / "mixed.jsonl", rows))


def test_block_tokens_come_from_the_rows_ids_unless_the_format_says():
    # Mooncake's rows fit 512 (1100 tokens in 3 ids); a row of one id cannot tell, so a file of only those stays 512
    assert _mooncake().requests[0].segments[0][2] == 512
    one = parse_jsonl([json.dumps({"timestamp": 0, "input_length": 40, "output_length": 2, "hash_ids": [1]})])
    assert one.requests[0].segments == ((NS_MOONCAKE, 1, 40),)
    # 130 tokens in 3 ids: 64 each (ceil(130 / 64) = 3); the most common answer wins over a row that fits another
    rows = [{"timestamp": i, "input_length": 130, "output_length": 2, "hash_ids": [1, 2, 3]} for i in range(3)]
    rows.append({"timestamp": 9, "input_length": 100, "output_length": 2, "hash_ids": [1, 2, 3, 4, 5, 6, 7]})  # 16
    t = parse_jsonl(json.dumps(r) for r in rows)
    assert [n for _, _, n in t.requests[0].segments] == [64, 64, 2]


def test_a_batch_job_is_paced_as_a_poisson_stream_in_file_order():
    batch = parse_jsonl(json.dumps(r) for r in ACDC_STAT_ROWS * 200)
    paced = pace_batch(batch, 4.0, seed=3)
    times = [r.arrival_s for r in paced.requests]
    assert times[0] == 0.0 and times == sorted(times) and has_clock(paced)
    assert [r.num_prompt_tokens for r in paced.requests] == [r.num_prompt_tokens for r in batch.requests]
    assert paced.mean_rate == pytest.approx(4.0, rel=0.15)  # 400 exponential gaps of mean 0.25 s
    assert pace_batch(batch, 4.0, seed=3) == paced and pace_batch(batch, 4.0, seed=4) != paced
    clocked = _mooncake()
    assert pace_batch(clocked, 4.0) is clocked and has_clock(clocked)


def test_fill_outputs_draws_only_the_lengths_a_trace_lacks():
    t = Trace("t", tuple(TraceRequest(k, float(i), 5, out, ((NS_UNIQUE, i, 5),))
                         for i, (k, out) in enumerate((("a", 0), ("b", 7), ("c", 0)))))
    calls = []

    def draw(rng, n):
        calls.append(n)
        return np.array([0, 42])  # a draw of 0 still gives a length of 1

    f = fill_outputs(t, draw, seed=1)
    assert [r.num_output_tokens for r in f.requests] == [1, 7, 42] and calls == [2]
    assert fill_outputs(f, draw) is f and calls == [2]


BURSTGPT = (
    "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\r\n"
    "5,ChatGPT,472,18,490,Conversation log\r\n"
    "45,GPT-4,1087,30,1117,API log\r\n"
    "46,ChatGPT,20,7,27,API log\r\n"
    "50,GPT-4,300,9,309,Conversation log\r\n"
)


def test_where_keeps_the_rows_with_the_values_asked_before_the_slice(tmp_path):
    # BurstGPT mixes two models and two kinds of log: one fleet serves one model, so a replay picks its rows. The
    # kept rows are re-based from the first kept one, and the window applies to them
    p = tmp_path / "BurstGPT_1.csv"
    p.write_text(BURSTGPT, newline="")
    t = load_trace(str(p), where={"Model": ["ChatGPT"]})
    assert [(r.arrival_s, r.num_prompt_tokens) for r in t.requests] == [(0.0, 472), (41.0, 20)]
    t = load_trace(str(p), where={"Model": ["GPT-4"], "Log Type": ["API log", "Conversation log"]})
    assert [(r.arrival_s, r.num_prompt_tokens) for r in t.requests] == [(0.0, 1087), (5.0, 300)]
    t = load_trace(str(p), where={"Model": ["ChatGPT", "GPT-4"], "Log Type": ["API log"]}, start_s=0.5)
    assert [(r.arrival_s, r.num_prompt_tokens) for r in t.requests] == [(0.0, 20)]  # 45 s and 46 s; from 45.5
    assert parse_csv(io.StringIO(BURSTGPT), where={"Model": ["GPT-4"]}).requests == load_trace(
        str(p), where={"Model": ["GPT-4"]}).requests
    # a column the file lacks, or a value no row has, is an error naming what the file has (not an empty trace)
    with pytest.raises(ValueError, match="no column 'model'.*'Log Type'"):
        load_trace(str(p), where={"model": ["ChatGPT"]})
    with pytest.raises(ValueError, match="no row has Model in \\['chatgpt'\\].*'ChatGPT', 'GPT-4'"):
        load_trace(str(p), where={"Model": ["chatgpt"]})
    # a column of distinct values (timestamps) is counted only so far: the error still names some of them
    many = tmp_path / "many.csv"
    many.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                    + "".join(f"{i},ChatGPT,5,2,7,x\n" for i in range(1500)))
    with pytest.raises(ValueError, match="no row has Timestamp in \\['x'\\].*'0', '1'"):
        load_trace(str(many), where={"Timestamp": ["x"]})
    rf = _RowFilter({"Timestamp": ["x"]}, "t")
    for i in range(1500):
        rf.keep([str(i)])
    assert len(rf.seen["Timestamp"]) == _RowFilter.MAX_SEEN and rf.kept == 0
    # Qwen-Bailian: JSON fields, compared as text; a Mooncake row has no `type` to select on
    rows = [
        {"chat_id": 1, "parent_chat_id": -1, "timestamp": 10.0, "input_length": 40, "output_length": 5,
         "type": "image", "turn": 1, "hash_ids": [1, 2, 3]},
        {"chat_id": 2, "parent_chat_id": -1, "timestamp": 11.0, "input_length": 20, "output_length": 6,
         "type": "text", "turn": 1, "hash_ids": [4, 5]},
        {"chat_id": 3, "parent_chat_id": 2, "timestamp": 13.0, "input_length": 50, "output_length": 7,
         "type": "text", "turn": 2, "hash_ids": [4, 5, 6, 7]},
    ]
    q = tmp_path / "qwen_traceA_blksz_16.jsonl"
    q.write_text("".join(json.dumps(r) + "\n" for r in rows))
    t = load_trace(str(q), where={"type": ["text"]})
    assert [(r.arrival_s, r.num_output_tokens) for r in t.requests] == [(0.0, 6), (2.0, 7)]
    assert [n for _, _, n in t.requests[1].segments] == [16, 16, 16, 2]  # still Bailian's 16-token blocks
    assert [r.num_output_tokens for r in load_trace(str(q), where={"turn": ["2"]}).requests] == [7]
    m = tmp_path / "m.jsonl"
    m.write_text("\n".join(json.dumps(r) for r in MOONCAKE_ROWS) + "\n")
    with pytest.raises(ValueError, match="line 1: .*no field 'type' to select on"):
        load_trace(str(m), where={"type": ["text"]})
    assert parse_where(["Model=ChatGPT", " Log Type = API log", "Model=GPT-4"]) == {
        "Model": ["ChatGPT", "GPT-4"], "Log Type": ["API log"]}
    for bad in ("Model", "=x"):
        with pytest.raises(ValueError, match="COLUMN=VALUE"):
            parse_where([bad])


def test_gzip_traces_read_as_the_files_they_hold(tmp_path):
    # the Azure 2024 week files and the 2025 multimodal trace are published gzip-compressed: the same requests,
    # told by the magic bytes, the format from the suffix under .gz (or sniffed), the name without .gz
    plain = tmp_path / "BurstGPT_1.csv"
    plain.write_text(BURSTGPT, newline="")
    packed = tmp_path / "BurstGPT_1.csv.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    odd = tmp_path / "burst.data"  # no telling suffix: the header is sniffed through the decompression
    odd.write_bytes(packed.read_bytes())
    want = load_trace(str(plain))
    for f in (packed, odd):
        got = load_trace(str(f), where={"Model": ["ChatGPT", "GPT-4"]})
        assert got.requests == want.requests and len(got.requests) == 4
    assert load_trace(str(packed)).name == "burstgpt-1"
    j = tmp_path / "m.jsonl.gz"
    j.write_bytes(gzip.compress(("\n".join(json.dumps(r) for r in MOONCAKE_ROWS) + "\n").encode()))
    assert load_trace(str(j)).requests == parse_jsonl(json.dumps(r) for r in MOONCAKE_ROWS).requests


def test_chunks_made_in_one_pass_are_the_reference_chunks():
    # `chunks_tokens` makes many chunks' first tokens in one vectorised pass: each must be `chunk_tokens`' prefix
    pieces = [(NS_MOONCAKE, 7, 0, 16), (NS_UNIQUE, 3, 2, 512), (NS_MOONCAKE, 7, 1, 1), (2, 2**40, 0, 300)]
    got = chunks_tokens(5, pieces)
    assert [len(g) for g in got] == [16, 512, 1, 300]
    for (ns, key, c, take), g in zip(pieces, got, strict=True):
        assert g.tolist() == chunk_tokens(5, ns, key, c)[:take].tolist()


def test_azure_2024_timestamps_carry_a_utc_offset():
    # Azure's 2024 week traces: 6 digits and "+00:00"; an offset is taken off (read in UTC), so the 01:00 stamp at
    # +01:00 is 2 s after midnight UTC's first; "Z", "T" and whole seconds read as well; a stamp without a zone is
    # UTC, and one that the offset moves past midnight lands on the next day
    raw = (
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2024-05-10 00:00:00.009930+00:00,2162,5\n"
        "2024-05-10T00:00:01Z,100,7\n"
        "2024-05-10 01:00:02.000000+01:00,200,9\n"
        "2024-05-10 00:00:03.5,300,11\n"
        "2024-05-09 17:00:04-0700,400,13\n"
    )
    t = parse_csv(io.StringIO(raw, newline=""))
    assert [r.arrival_s for r in t.requests] == pytest.approx([0.0, 0.99007, 1.99007, 3.49007, 3.99007])
    assert [r.num_prompt_tokens for r in t.requests] == [2162, 100, 200, 300, 400]
    with pytest.raises(ValueError, match="line 2"):  # the first data row's stamp is not a time
        parse_csv(io.StringIO("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-05-10,1,1\n"))


def test_azure_2025_multimodal_trace(tmp_path):
    # Azure's LMM trace 2025 (AzurePublicDataset's AzureLMMInferenceDataset2025.md and its notebook: columns
    # TIMESTAMP, NumImages, ContextTokens, GeneratedTokens; stamps '2024-10-15T12:00:00.269Z'; published gzip): read
    # as an Azure trace, NumImages ignored unless a --where picks on it (text-only requests: NumImages=0)
    raw = (
        "TIMESTAMP,NumImages,ContextTokens,GeneratedTokens\n"
        "2024-10-15T12:00:00.269Z,0,770,491\n"
        "2024-10-15T12:00:05.819Z,1,949,126\n"
        "2024-10-15T12:00:06.513Z,1,964,79\n"
        "2024-10-15T12:00:07.332Z,0,78,5\n"
    )
    p = tmp_path / "AzureLMMInferenceTrace_multimodal.csv.gz"
    p.write_bytes(gzip.compress(raw.encode()))
    t = load_trace(str(p))
    assert t.name == "azurelmminferencetrace-multimodal"
    assert [r.arrival_s for r in t.requests] == pytest.approx([0.0, 5.55, 6.244, 7.063])
    assert [(r.num_prompt_tokens, r.num_output_tokens) for r in t.requests] == [(770, 491), (949, 126), (964, 79),
                                                                              (78, 5)]
    text = load_trace(str(p), where={"NumImages": ["0"]})
    assert [(r.arrival_s, r.num_prompt_tokens) for r in text.requests] == [(0.0, 770), (pytest.approx(7.063), 78)]


def _at(times: list[float]) -> Trace:
    return Trace("t", tuple(TraceRequest(str(i), t, i + 1, 1, ()) for i, t in enumerate(times)))


def _stamps(trace: Trace) -> int:
    return len({r.arrival_s for r in trace.requests})


def test_spread_ties_spreads_each_stamp_over_the_clock_s_step():
    # a 3 s clock (the least gap between stamps): each request lands in [its stamp, its stamp + 3 s), whatever the
    # gap to the next stamp; one stamp's requests in the file's order; the same seed gives the same times
    t = _at([0.0, 0.0, 0.0, 3.0, 6.0, 6.0, 12.0, 12.0])
    assert _stamps(t) == 4
    s = spread_ties(t, seed=1)
    got = [r.arrival_s for r in s.requests]
    assert [r.num_prompt_tokens for r in s.requests] == list(range(1, 9))  # the file's order
    assert got == sorted(got) and len(set(got)) == 8
    steps = [(0, 3), (0, 3), (0, 3), (3, 6), (6, 9), (6, 9), (12, 15), (12, 15)]  # 6 -> 12: an empty step
    assert all(lo <= x < hi for x, (lo, hi) in zip(got, steps, strict=True))
    assert spread_ties(t, seed=1) == s and spread_ties(t, seed=2) != s
    # a fine clock with one coincidence: nothing moves further than its least gap
    fine = _at([0.0, 0.0, 0.004, 0.5, 2.0])
    moved = [b.arrival_s - a.arrival_s for a, b in zip(fine.requests, spread_ties(fine).requests, strict=True)]
    assert all(0 <= m < 0.004 for m in moved)
    plain = _at([0.0, 0.5, 2.0])
    assert _stamps(plain) == 3 and spread_ties(plain) is plain
    assert spread_ties(_at([1.0, 1.0])).requests == _at([1.0, 1.0]).requests  # one stamp: no step


def test_mooncake_s_clock_steps_by_three_seconds():
    # why --spread-ties exists: the conversation trace's stamps step by ~3 s, ~10 requests a step
    t = load_trace("mooncake-conversation")
    times = sorted({r.arrival_s for r in t.requests})
    assert len(times) < len(t.requests) / 8
    steps = np.diff(times)
    assert np.all(np.abs(steps - 3.0) <= 0.005)
    spread = spread_ties(t)
    assert _stamps(spread) == len(spread.requests) == len(t.requests)
    assert spread.mean_rate == pytest.approx(t.mean_rate, rel=0.01)


def test_burstgpt_and_splitwise_csv(tmp_path):
    # BurstGPT: relative seconds and its own column names (its other columns are not read); a byte-order mark and
    # a failed request (0 tokens) are kept as in the Azure files: one arrival of one token
    p = tmp_path / "BurstGPT_1.csv"
    p.write_bytes(
        b"\xef\xbb\xbfTimestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\r\n"
        b"5,ChatGPT,472,18,490,Conversation log\r\n"
        b"45,GPT-4,1087,0,1087,API log\r\n"
        b"46,ChatGPT,0,0,0,Conversation log\r\n"
    )
    t = load_trace(str(p))
    assert t.name == "burstgpt-1"
    assert [r.arrival_s for r in t.requests] == [0.0, 40.0, 41.0]
    assert [(r.num_prompt_tokens, r.num_output_tokens) for r in t.requests] == [(472, 18), (1087, 1), (1, 1)]
    assert not t.has_prefix_identity
    # splitwise-sim's (and SageServe's) traces: relative seconds, sniffed from the header without a .csv suffix
    q = tmp_path / "code_distributions.trace"
    q.write_text("request_id,request_type,application_id,arrival_timestamp,batch_size,prompt_size,token_size\n"
                 "0,2,0,0.25,1,1020,129\n1,2,0,0.125,1,374,44\n")
    t = load_trace(str(q))
    assert [(r.arrival_s, r.num_prompt_tokens, r.num_output_tokens) for r in t.requests] == [(0.0, 374, 44),
                                                                                            (0.125, 1020, 129)]
    bad = tmp_path / "other.csv"
    bad.write_text("time,input,output\n1,2,3\n")
    with pytest.raises(ValueError, match="ContextTokens.*Request tokens.*prompt_size"):  # names what it reads
        load_trace(str(bad))
    # corrupt rows name their line: a time that is not a number (or not finite), a negative count, a short row
    head = "request_id,request_type,application_id,arrival_timestamp,batch_size,prompt_size,token_size\n"
    for row in ("0,2,0,nan,1,10,10", "0,2,0,1.5,1,-3,10", "0,2,0,x,1,10,10", "0,2,0,1.5"):
        bad.write_text(head + "0,2,0,0.5,1,10,10\n" + row + "\n")
        with pytest.raises(ValueError, match="line 3"):
            load_trace(str(bad))
    j = tmp_path / "bad.jsonl"
    j.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"timestamp": 1, "input_length": 5}\n')
    with pytest.raises(ValueError, match="line 2: not a JSONL trace row"):
        load_trace(str(j))


@pytest.mark.parametrize("fmt", ["mooncake", "azure"])
def test_load_trace_window_equals_slicing_the_whole_trace(tmp_path, fmt):
    # the window is cut while reading (only its requests are built), so it must be exactly `take_slice` of the
    # whole trace, request ids and unique-token keys included: rows out of order and tied, random windows
    rng = random.Random(7)
    times = [rng.choice([0, 250, 1000, 1000, 4000]) + rng.randrange(0, 60_000) for _ in range(300)]
    times[5] = times[6]  # a tie: file order breaks it
    if fmt == "mooncake":
        path = tmp_path / "t.jsonl"
        rows = [{"timestamp": t, "input_length": 600 + i, "output_length": i, "hash_ids": [i % 7, i]}
                for i, t in enumerate(times)]
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    else:
        path = tmp_path / "t.csv"
        stamps = [f"2024-05-10 {t // 3_600_000:02d}:{t // 60_000 % 60:02d}:{t % 60_000 / 1000:09.6f}+00:00"
                  for t in times]
        path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                        + "".join(f"{s},{600 + i},{i}\n" for i, s in enumerate(stamps)))
    whole = load_trace(str(path))
    assert [r.arrival_s for r in whole.requests] == sorted(r.arrival_s for r in whole.requests)
    assert [r.request_id for r in whole.requests] == [f"r{i}" for i in range(300)]
    windows = [(0.0, None, None), (0.0, 10.0, None), (3.5, 20.0, 40), (0.0, None, 1), (30.0, None, None),
               (100.0, 5.0, None), *((rng.uniform(0, 60), rng.uniform(0, 30), rng.choice([None, 5, 50]))
                                     for _ in range(20))]
    for start, duration, most in windows:
        assert load_trace(str(path), start, duration, most) == take_slice(whole, start, duration, most)


def test_slice_and_time_scaling():
    t = _mooncake()  # arrivals 0, 0, 1.5, 3.0: mean rate (4 - 1) / 3 = 1 req/s
    assert t.mean_rate == pytest.approx(1.0)
    s = take_slice(t, start_s=1.0, duration_s=5.0)
    assert [r.arrival_s for r in s.requests] == [0.0, 1.5]  # 1.5 and 3.0, re-based to 0
    assert len(take_slice(t, max_requests=2).requests) == 2
    assert [r.arrival_s for r in scale_time(t, 0.5).requests] == [0.0, 0.0, 0.75, 1.5]  # half the gaps
    r4 = scale_to_rate(t, 4.0)
    assert r4.mean_rate == pytest.approx(4.0)
    assert [r.arrival_s for r in r4.requests] == pytest.approx([0.0, 0.0, 0.375, 0.75])
    with pytest.raises(ValueError):
        scale_time(t, 0.0)


def test_named_traces_found():
    t = load_trace("azure-conv")
    assert len(t.requests) == 19366
    assert t.requests[0].num_prompt_tokens == 374
