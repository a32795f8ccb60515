"""A keyed stream's per-key state files (``keyed.files``) against a plain dict of every key's state: random
changes, random calls that fail before they commit, replays from an older list of files, processes that
start afresh, and merges. A batch writes only the keys it touched."""

from __future__ import annotations

import functools
import pickle
import random

import pyarrow.parquet as pq
import pytest

from streaming.keyed import KeyedProcessFunction, ValueStateDescriptor
from streaming.keyed import files as keys
from streaming.keyed.runtime import KeyedRuntime, as_bytes


def _loaded(state) -> dict:
    return pickle.loads(as_bytes(state))


def _truth_after(history: list[dict]) -> dict:
    state: dict = {}
    for changed in history:
        for key, row in changed.items():
            if row is None:
                state.pop(key, None)
            else:
                state[key] = row
    return state


@pytest.mark.parametrize("every", [None, 2, 3], ids=["default", "every-2", "every-3"])
@pytest.mark.parametrize("seed", range(6))
def test_the_view_holds_what_the_named_files_say_through_failures_replays_and_merges(tmp_path, seed, every):
    """``every``: runs per level (small: runs are merged level upon level, and bases rewritten, within the test)."""
    rng = random.Random(seed)
    root = str(tmp_path / "keys")
    bucket = rng.randrange(16)
    committed: list[tuple[list[str], dict]] = [([], {})]  # (the bucket's files, the state they hold) per batch
    history: list[dict] = []
    for batch in range(60):
        files, truth = committed[-1]
        if rng.random() < 0.1:
            keys.forget()  # a Python worker that starts afresh
        if rng.random() < 0.1 and len(committed) > 1:  # a replay: the batch before's files, as Spark's state has them
            committed.pop()
            history.pop()
            files, truth = committed[-1]
        view = keys.view(root, bucket, files, {})
        assert view.rows == truth, f"batch {batch}"
        watermark = batch * 10
        due = view.due(watermark)
        assert sorted(due) == sorted(k for k, r in truth.items() if r[1] is not None and r[1] <= watermark)
        changed = {}
        for key in [*due, *rng.sample(range(40), rng.randrange(6))]:
            if key in truth and rng.random() < 0.25:
                changed[key] = None
            else:
                changed[key] = (f"{key}@{batch}".encode(), watermark + rng.randrange(1, 40), None)
        for key in due:  # a due key that keeps its row would be woken again and again: it always changes
            if changed[key] is not None and changed[key][1] <= watermark:
                changed[key] = (changed[key][0], watermark + 1, None)
        if rng.random() < 0.1:
            continue  # the call failed before it committed: the view was taken and is rebuilt next time
        keys.commit(root, bucket, view, changed, {}, every=every)
        assert view.files and all((tmp_path / "keys" / str(bucket) / f).exists() for f in view.files) or not view.rows
        expected = _truth_after([truth, changed])
        assert view.rows == expected
        assert view.earliest_wake() == min((r[1] for r in expected.values() if r[1] is not None), default=None)
        assert len(view.files) <= 4 * max(2, keys.compact_after(bucket, every))
        committed.append((list(view.files), expected))
        history.append(changed)


def test_a_batch_writes_only_the_keys_it_touched_and_a_merge_drops_the_older_files(tmp_path):
    root = str(tmp_path / "keys")
    view = keys.view(root, 3, [], {})
    keys.commit(root, 3, view, {k: (b"x" * 100, 1_000 + k, None) for k in range(10_000)}, {})
    assert keys._level(view.files[0]) == "b"  # (a bucket's first file is its base)
    every = keys.compact_after(3)
    for n in range(1, every):
        files = list(view.files)
        view = keys.view(root, 3, files, {})
        dropped = keys.commit(root, 3, view, {n: (b"y", 5, None), 10_000 + n: (b"z", None, None)}, {})
        assert dropped == [] and view.files[:-1] == files
        assert pq.read_metadata(tmp_path / "keys" / "3" / view.files[-1]).num_rows == 2
    files = list(view.files)
    view = keys.view(root, 3, files, {})
    dropped = keys.commit(root, 3, view, {0: None}, {})  # the runs are merged into one, their rows in order; the base stays
    assert dropped == files[1:] and view.files[0] == files[0] and len(view.files) == 2
    assert keys._level(view.files[1]) == "1"
    assert pq.read_metadata(tmp_path / "keys" / "3" / view.files[1]).num_rows == 2 * (every - 1) + 1
    files = list(view.files)
    view = keys.view(root, 3, files, {})
    dropped = keys.commit(root, 3, view, {k: (b"w" * 200, None, None) for k in range(20_000, 30_000)}, {})  # outweighs the base
    assert dropped == files and len(view.files) == 1 and keys._level(view.files[0]) == "b"
    assert pq.read_metadata(tmp_path / "keys" / "3" / view.files[0]).num_rows == len(view.rows) == 20_000 + (every - 1) - 1
    keys.forget()
    again = keys.view(root, 3, view.files, {})
    assert again.rows == view.rows and again.earliest_wake() == 5
    emptied = keys.commit(root, 3, again, {k: None for k in list(again.rows)}, {})
    assert emptied == view.files and again.files == [] and not again.rows  # a bucket without keys keeps no file


def _rows_in(tmp_path, bucket, names) -> int:
    return sum(pq.read_metadata(tmp_path / "keys" / str(bucket) / n).num_rows for n in names)


def test_runs_merge_level_by_level_and_a_large_base_is_not_rewritten_for_small_batches(tmp_path):
    """What a bucket's files cost a batch follows what batches write, not what the bucket holds: a bucket of 10,000
    keys whose batches change 20 keys each merges its runs level by level, and keeps its base until the runs weigh
    as much (with a merge of the whole bucket every ~16 files, 300 batches wrote ~190,000 rows). Read back by a
    process that starts afresh, the files hold every key's newest row."""
    root = str(tmp_path / "keys")
    view = keys.view(root, 3, [], {})
    truth = {k: (b"x" * 100, 100_000 + k, None) for k in range(10_000)}
    keys.commit(root, 3, view, dict(truth), {}, whole=True)
    base = view.files[0]
    every = keys.compact_after(3)
    rng = random.Random(5)
    written = 0
    for batch in range(300):
        before = set(view.files)
        view = keys.view(root, 3, list(view.files), {})
        changed = {k: (f"{k}@{batch}".encode(), 5_000 + batch, None) for k in rng.sample(range(12_000), 20)}
        for k in rng.sample(sorted(truth), 2):
            changed[k] = None
        dropped = keys.commit(root, 3, view, changed, {})
        truth = _truth_after([truth, changed])
        assert view.files[0] == base and base not in dropped, f"batch {batch}: the base was rewritten"
        assert set(dropped) <= before and not set(dropped) & set(view.files)  # (only files named before the call)
        assert len(view.files) <= 1 + 3 * (every - 1), view.files
        written += _rows_in(tmp_path, 3, [f for f in view.files if f not in before])
        assert view.rows == truth
    assert written <= 3 * 22 * 300, written  # (each row written once as a run, then once per level: ~2 levels here)
    keys.forget()
    again = keys.view(root, 3, list(view.files), {})
    assert again.rows == truth
    assert again.earliest_wake() == min(r[1] for r in truth.values() if r[1] is not None)


def test_a_base_is_rewritten_once_the_runs_outweigh_it(tmp_path):
    """A small bucket whose batches rewrite most of its keys writes its whole state again soon, dropping every
    older file; a bucket of files named by an older lakestream (no sizes) is merged as it merged them."""
    root = str(tmp_path / "keys")
    view = keys.view(root, 4, [], {})
    keys.commit(root, 4, view, {k: (b"s" * 50, None, None) for k in range(10)}, {}, whole=True)
    base = view.files[0]
    truth = dict(view.rows)
    for batch in range(4):
        files = list(view.files)
        view = keys.view(root, 4, files, {})
        changed = {k: (b"t" * 60, None, None) for k in range(5)}
        dropped = keys.commit(root, 4, view, changed, {})
        truth = _truth_after([truth, changed])
        if dropped:
            assert dropped[0] == base and set(dropped) == set(files) and len(view.files) == 1
            assert keys._level(view.files[0]) == "b"
            assert pq.read_metadata(tmp_path / "keys" / "4" / view.files[0]).num_rows == len(truth)
            break
    else:
        raise AssertionError("runs of 5 keys x 60 bytes never outweighed a base of 10 keys x 50 bytes")
    keys.forget()
    assert keys.view(root, 4, list(view.files), {}).rows == truth
    # files an older lakestream wrote (names without kind or size): merged into one base after ``compact_after``
    old = str(tmp_path / "old")
    view = keys.view(old, 1, [], {})
    every = keys.compact_after(1)
    for n in range(every - 1):
        keys.commit(old, 1, view, {n: (b"o", None, None)}, {})
        path = tmp_path / "old" / "1" / view.files[-1]
        legacy = path.with_name(f"{n:032x}.parquet")
        path.rename(legacy)
        view.files[-1] = legacy.name
    keys.forget()
    view = keys.view(old, 1, list(view.files), {})
    assert keys._size(view.files[0]) is None and len(view.files) == every - 1
    dropped = keys.commit(old, 1, view, {"new": (b"n", None, None)}, {})
    assert len(dropped) == every - 1 and len(view.files) == 1 and keys._level(view.files[0]) == "b"
    keys.forget()
    assert set(keys.view(old, 1, list(view.files), {}).rows) == {*range(every - 1), "new"}


class _Counter(KeyedProcessFunction):
    """Counts a key's elements (its state besides the remembered ids)."""

    def open(self, ctx):
        self.n = ctx.get_state(ValueStateDescriptor("n", "long"))

    def process_element(self, value, ctx):
        self.n.update((self.n.value() or 0) + 1)
        return None


@pytest.mark.parametrize("every", [6, 2], ids=["every-6", "every-2"])
@pytest.mark.parametrize("live", [False, True], ids=["bytes", "objects"])
@pytest.mark.parametrize("seed", range(4))
def test_keys_that_remember_many_ids_store_only_what_a_batch_added_and_read_back_whole(tmp_path, seed, live, every):
    """The keyed runtime's remembered ids and buffered elements are most of a busy key's state: a key file keeps a
    key's state without them and the ids and elements the batch added (with the horizon it forgot older ids at and
    the watermark it delivered elements up to), and a reader merges them into the state before. Against the writer's
    own states: random events (late, buffered, re-delivered) with ids expiring, workers that start afresh, calls that
    fail before they commit, replays from the batch before, merges of the files. ``live``: the view keeps the states
    of the keys a call ran as objects (as a stream's worker does), and merges into them."""
    rng = random.Random(seed)
    root = str(tmp_path / "keys")
    ttl = 8_000
    rt = KeyedRuntime(_Counter, ["v"], ["n"], ttl)
    committed: list[tuple[list[str], dict]] = [([], {})]  # (the bucket's files, every key's state) per batch
    partial = whole = 0
    for batch in range(50):
        files, truth = committed[-1]
        if rng.random() < 0.15:
            keys.forget()  # a Python worker that starts afresh: it reads every file, merging the partial rows
        if rng.random() < 0.1 and len(committed) > 1:  # a replay: the batch before's files, as Spark's state has them
            committed.pop()
            files, truth = committed[-1]
        view = keys.view(root, 5, files, {}, merge=functools.partial(KeyedRuntime.merged, live=live))
        assert {k: _loaded(r[0]) for k, r in view.rows.items()} == {k: _loaded(s) for k, s in truth.items()}
        watermark = batch * 1_000
        changed, states = {}, dict(truth)
        for key in rng.sample(range(12), rng.randrange(1, 8)):
            row = view.rows.get(key)
            events = [(watermark + rng.randrange(-2_000, 3_000), f"id-{key}-{rng.randrange(60)}", (1,))
                      for _ in range(rng.randrange(1, 25))]
            r = rt.process((key,), row[0] if row else None, events, watermark, 0, live=live)
            changed[key] = None if r.state is None else (r.state, r.wakeup_ms, None, r.stored)
            if r.state is None:
                states.pop(key, None)
            else:
                states[key] = as_bytes(r.state)  # (as the call left it: objects change in the key's next call)
                assert r.stored is None or not {"ids", "buf"} & set(pickle.loads(r.stored[0]))
        if rng.random() < 0.1:
            continue  # the call failed before it committed: the view was taken and is rebuilt next time
        keys.commit(root, 5, view, changed, {}, every=every)
        newest = pq.read_table(tmp_path / "keys" / "5" / view.files[-1]) if view.files else None
        if newest is not None and "a" in newest.column_names:
            partial += 1
            parts = [pickle.loads(s) for s, a in zip(newest.column("s").to_pylist(), newest.column("a").to_pylist()) if a]
            assert parts and not any({"ids", "seen", "buf"} & set(part) for part in parts)  # no id, no element in a part
        elif newest is not None:
            whole += 1
        assert {k: _loaded(r[0]) for k, r in view.rows.items()} == {k: _loaded(s) for k, s in states.items()}
        if live:  # (the view keeps objects for the keys this call ran, not for the others)
            assert {k for k, r in view.rows.items() if not isinstance(r[0], bytes)} <= set(changed)
        committed.append((list(view.files), states))
    assert partial and whole  # batches wrote partial rows, and merges wrote every key whole
