import json
import shutil

import numpy as np
import pytest

from helpers import environment_without, read_run, run_liandan, tiny_config, write_corpus
from liandan.data import (
    ByteTokenizer,
    DataError,
    Document,
    MixtureSchedule,
    PackedLoader,
    TokenStore,
    shard_path,
    write_manifest,
    write_shard,
)
from liandan.data.pipeline.prepare import open_stores
from liandan.data.tokens.store import HEADER_SIZE, ShardHeader


def _topics():
    from pydoc_data.topics import topics

    return [(name, topics[name]) for name in sorted(topics)]


def _store(directory, docs, shards=1):
    per_shard = -(-len(docs) // shards)
    infos = [
        write_shard(docs[i * per_shard : (i + 1) * per_shard], ByteTokenizer(), shard_path(directory, i))
        for i in range(shards)
    ]
    write_manifest(directory, infos, ByteTokenizer())
    return TokenStore(directory)


@pytest.fixture(scope="module")
def corpus():
    """Three sources of real prose: (source, id) -> text."""
    topics = _topics()
    return {
        name: [Document(name, topic, text) for topic, text in topics[start : start + n]]
        for name, start, n in (("alpha", 0, 30), ("beta", 30, 20), ("gamma", 54, 4))
    }


@pytest.fixture(scope="module")
def stores(corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("stores")
    return [_store(root / name, docs, shards=3 if name == "alpha" else 1) for name, docs in corpus.items()]


def test_mixture_counts_stay_within_one_of_their_targets(stores):
    weights = [0.5, 0.3, 0.2]
    loader = PackedLoader(stores, seq_len=32, global_batch=16, seed=1, weights=weights)
    seen = np.zeros(3)
    for step in range(300):
        store_of_sample, _ = loader.windows_for_step(step)
        seen += np.bincount(store_of_sample, minlength=3)
        assert np.all(np.abs(seen - np.array(weights) * (step + 1) * 16) < 1 + 1e-9), step
    # the in-batch shuffle gives each of two ranks a mix rather than whole stores
    assert len(set(store_of_sample[:8])) > 1 and len(set(store_of_sample[8:])) > 1


def test_mixture_schedule_holds_for_awkward_weights():
    rng = np.random.default_rng(0)
    for _ in range(60):
        n = int(rng.integers(2, 7))
        weights = rng.dirichlet(np.full(n, 0.3)) + 1e-6  # some far below one sample per step
        batch = int(rng.integers(1, 33))
        schedule = MixtureSchedule(weights.tolist(), batch)
        normalized = weights / weights.sum()
        for step in range(1, 400):
            counts = schedule.counts(step - 1)
            assert counts.min() >= 0 and counts.sum() == batch
            assert np.all(np.abs(schedule.consumed(step) - normalized * step * batch) < 1 + 1e-9)
    # a state restored mid-run continues the same sequence; a made-up one is refused
    schedule, fresh = MixtureSchedule([0.7, 0.2, 0.1], 8), MixtureSchedule([0.7, 0.2, 0.1], 8)
    fresh.restore(37, schedule.extras(37))
    assert [fresh.counts(s).tolist() for s in range(37, 60)] == [schedule.counts(s).tolist() for s in range(37, 60)]
    with pytest.raises(DataError, match="mixture counters"):
        fresh.restore(37, [0, 0, 0])


def test_a_store_of_weight_zero_is_never_trained_on_but_keeps_its_held_out_windows(stores):
    loader = PackedLoader(stores, seq_len=32, global_batch=16, seed=1, val_fraction=0.1, weights=[0.7, 0.0, 0.3])
    seen = np.zeros(3)
    for step in range(200):
        seen += np.bincount(loader.stores_for_step(step), minlength=3)
    assert seen[1] == 0 and abs(seen[0] - 0.7 * 200 * 16) < 1
    assert len(loader.streams[1].val_windows) > 0


def test_runs_of_other_seeds_share_the_held_out_windows_of_one_split_seed(stores):
    def loader(seed: int, split_seed: int = -1) -> PackedLoader:
        return PackedLoader(stores, 32, 8, seed=seed, val_fraction=0.2, weights=[1, 1, 1], split_seed=split_seed)

    a, b, c = loader(1, split_seed=7), loader(2, split_seed=7), loader(7)
    for i in range(3):
        assert np.array_equal(a.streams[i].val_windows, b.streams[i].val_windows)
        assert np.array_equal(a.streams[i].val_windows, c.streams[i].val_windows)
        assert not np.array_equal(loader(1).streams[i].val_windows, a.streams[i].val_windows)
    assert not np.array_equal(a.windows_for_step(0)[1], b.windows_for_step(0)[1])  # the data order is the seed's
    with pytest.raises(DataError, match="split_seed"):
        loader(1).load_state_dict(a.state_dict())
    assert "split_seed" not in c.state_dict()  # a state of the default split loads as states saved before it did


def test_default_weights_follow_token_counts(stores):
    loader = PackedLoader(stores, seq_len=32, global_batch=64, seed=0)
    tokens = np.array([s.num_tokens for s in stores])
    assert loader.schedule.weights == pytest.approx(tokens / tokens.sum())


def test_batches_are_deterministic_and_seeded(stores):
    def first_steps(seed):
        loader = PackedLoader(stores, 32, 8, seed=seed, val_fraction=0.1, weights=[2, 1, 1])
        return [loader.next_step(4) for _ in range(3)]

    a, b, c = first_steps(7), first_steps(7), first_steps(8)
    for step_a, step_b in zip(a, b):
        for x, y in zip(step_a, step_b):
            assert x.inputs.equal(y.inputs) and x.doc_ids.equal(y.doc_ids)
    assert not a[0][0].inputs.equal(c[0][0].inputs)
    batch = a[0][0]
    assert batch.inputs.shape == (4, 32) and batch.inputs[:, 1:].equal(batch.targets[:, :-1])


def _global_batch(loaders, micro_batch):
    parts = [loader.next_step(micro_batch) for loader in loaders]
    return np.concatenate([b.inputs.numpy() for rank in parts for b in rank])


def test_resume_continues_exactly_and_with_any_number_of_ranks(stores):
    def loader(rank=0, size=1):
        return PackedLoader(stores, 32, 8, seed=3, val_fraction=0.05, dp_rank=rank, dp_size=size, weights=[1, 1, 2])

    straight = loader()
    reference = [_global_batch([straight], 8) for _ in range(120)]
    assert 120 * 8 / 2 > 2 * straight.streams[2].train_windows.size  # half the samples: gamma's epochs go round
    first = loader()
    for _ in range(50):
        first.next_step(2)
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint's meta.json keeps it
    for size in (1, 2, 4):
        ranks = [loader(r, size) for r in range(size)]
        for rank in ranks:
            rank.load_state_dict(state)
        for step in range(50, 70):
            assert np.array_equal(_global_batch(ranks, 1), reference[step]), (size, step)


def test_state_from_another_configuration_is_refused(stores):
    loader = PackedLoader(stores, 32, 8, seed=3, weights=[1, 1, 2])
    state = loader.state_dict()
    with pytest.raises(DataError, match="global_batch=8, this run has 16"):
        PackedLoader(stores, 32, 16, seed=3, weights=[1, 1, 2]).load_state_dict(state)
    with pytest.raises(DataError, match="weights="):
        PackedLoader(stores, 32, 8, seed=3, weights=[1, 1, 1]).load_state_dict(state)
    with pytest.raises(DataError, match="saved for other token stores"):
        PackedLoader(stores[:2], 32, 8, seed=3, weights=[1, 1]).load_state_dict({**state, "weights": [0.5, 0.5]})
    with pytest.raises(DataError, match="saved by an older liandan"):
        loader.load_state_dict({"step": 3, "seed": 3, "global_batch": 8, "seq_len": 32})


def test_documents_for_step_name_the_documents_the_tokens_came_from(stores, corpus):
    loader = PackedLoader(stores, 48, 12, seed=5, weights=[1, 1, 1])
    # Each store's documents laid end to end as they were written: (text, eos) per document, in order.
    laid_out = {}
    for name, docs in corpus.items():
        ids, owners = [], []
        for doc in docs:
            ids += list(doc.text.encode()) + [ByteTokenizer.eos_id]
            owners += [(doc.source, doc.doc_id)] * (len(doc.text.encode()) + 1)
        laid_out[name] = (np.array(ids), owners)
    for step in (0, 9):
        batch = loader.windows_for_step(step)
        rows = _global_tokens(loader, step)
        got, possible = set(), set()
        refs = loader.documents_for_step(step)
        got = {(r.source, r.doc_id) for r in refs}
        for store_index, row in zip(batch[0], rows):
            ids, owners = laid_out[loader.stores[store_index].name]
            # Real prose repeats itself, so a row may occur in several places; one of them must be it.
            candidates = [set(owners[hit : hit + len(row)]) for hit in _find(ids, row)]
            assert candidates, "a batch row is no stretch of its store's documents"
            assert any(c <= got for c in candidates)
            possible.update(*candidates)
        assert got <= possible
        assert {r.store for r in refs} <= {"alpha", "beta", "gamma"}


def _global_tokens(loader, step):
    stores, windows = loader.windows_for_step(step)
    batch = loader._batch(stores, windows)
    return np.concatenate([batch.inputs.numpy(), batch.targets.numpy()[:, -1:]], axis=1)


def _find(haystack, needle):
    windows = np.lib.stride_tricks.sliding_window_view(haystack, len(needle))
    return np.flatnonzero((windows == needle).all(axis=1)).tolist()


def test_windows_stay_inside_shards_and_document_ids_restart(stores):
    alpha = stores[0]
    loader = PackedLoader([alpha], 64, 16, seed=2)
    stream = loader.streams[0]
    all_windows = np.arange(int(stream.window_ends[-1]))
    shards, starts = stream.locate(all_windows)
    assert set(shards.tolist()) == {0, 1, 2}
    ends = np.array([alpha.shards[s].num_tokens for s in shards])
    assert np.all(starts + 65 <= ends)  # a window's tokens, its last target included, lie in one shard
    crossings = 0
    for step in range(10):
        batch = loader.next_step(16)[0]
        shards, starts = stream.locate(loader.windows_for_step(step)[1])
        for row, (shard_index, start) in enumerate(zip(shards, starts)):
            shard = alpha.shards[shard_index]
            assert batch.inputs[row].tolist() == shard.tokens[start : start + 64].tolist()
            docs = shard.document_of(start + np.arange(64))
            assert batch.doc_ids[row].tolist() == (docs - docs[0]).tolist()
        crossings += int((batch.doc_ids.max(dim=1).values > 0).sum())
    assert crossings > 0  # some sequences do span two documents


def test_validation_is_disjoint_from_training(stores):
    loader = PackedLoader(stores, 128, 16, seed=4, val_fraction=0.2, dp_size=2, dp_rank=1, weights=[3, 2, 1])
    trained = set()
    for step in range(200):  # past a whole epoch of every store
        store_of_sample, windows = loader.windows_for_step(step)
        trained.update(zip(store_of_sample.tolist(), windows.tolist()))
    for index, stream in enumerate(loader.streams):
        assert {w for s, w in trained if s == index} == set(stream.train_windows.tolist())
        assert not set(stream.val_windows.tolist()) & set(stream.train_windows.tolist())
        assert len(stream.val_windows) + len(stream.train_windows) == stream.window_ends[-1]
    batches = loader.validation(n_batches=2, batch_size=3)
    assert [b.inputs.shape[0] for b in batches] == [3, 3]
    val_rows = {tuple(row) for b in batches for row in b.inputs.tolist()}
    train_rows = {tuple(row) for s in range(40) for b in loader_steps(loader, s) for row in b.inputs.tolist()}
    assert not val_rows & train_rows


def loader_steps(loader, step):
    stores, windows = loader.windows_for_step(step)
    return [loader._batch(stores, windows)]


def test_bad_mixtures_are_refused(stores, tmp_path):
    with pytest.raises(DataError, match="2 mixture weights for 3 token stores"):
        PackedLoader(stores, 32, 8, seed=0, weights=[1, 2])
    with pytest.raises(DataError, match="must be non-negative numbers, not all zero"):
        PackedLoader(stores, 32, 8, seed=0, weights=[1, -1, 2])
    with pytest.raises(DataError, match="must be non-negative numbers, not all zero"):
        PackedLoader(stores, 32, 8, seed=0, weights=[0, 0, 0])
    with pytest.raises(DataError, match="must be non-negative numbers, not all zero"):
        PackedLoader(stores, 32, 8, seed=0, weights=[1, float("nan"), 2])
    tiny = _store(tmp_path / "tiny", [Document("t", "0", "just a few words")])
    with pytest.raises(DataError, match="too small for one training sequence of 256 tokens"):
        PackedLoader(tiny, 256, 4, seed=0)
    wide = tmp_path / "wide"
    from test_store import WideByteTokenizer

    write_manifest(wide, [write_shard([Document("t", "0", "x" * 400)], WideByteTokenizer(), shard_path(wide, 0))],
                   WideByteTokenizer())  # fmt: skip
    with pytest.raises(DataError, match="share one tokenizer"):
        PackedLoader([stores[0], TokenStore(wide)], 32, 8, seed=0)
    with pytest.raises(DataError, match=r"wide was tokenized with tokenizer wide-bytes .*expected byte-v1"):
        open_stores([str(stores[0].path), str(wide)])


def _store_with_foreign_ids(directory, docs, token_id):
    """A store whose shard holds `token_id`, beyond its vocabulary, in place of every token (as bit rot or a
    shard from another tokenizer could); its header and manifest still agree, so it opens."""
    _store(directory, docs)
    path = shard_path(directory, 0)
    header = ShardHeader.read(path)
    tokens = np.memmap(path, dtype=header.dtype, mode="r+", offset=HEADER_SIZE, shape=(header.tokens,))
    tokens[:] = token_id
    tokens.flush()
    return TokenStore(directory)


def test_a_token_id_outside_the_vocabulary_names_the_store(corpus, tmp_path):
    store = _store_with_foreign_ids(tmp_path / "foreign", corpus["beta"], 60000)
    loader = PackedLoader(store, 32, 4, seed=0, val_fraction=0.1)
    for read in (lambda: loader.next_step(4), lambda: loader.validation(1, 4)):
        with pytest.raises(DataError) as info:
            read()
        message = str(info.value)
        assert str(store.path) in message and "token id 60000" in message and "vocabulary of 257" in message
        assert "\n" not in message


@pytest.mark.slow
def test_an_out_of_range_token_id_ends_a_supervised_run_at_once(corpus, tmp_path):
    store = _store_with_foreign_ids(tmp_path / "foreign", corpus["alpha"], 60000)
    config = tmp_path / "run.toml"
    cfg = tiny_config(tmp_path / "runs", write_corpus(tmp_path), f'--data.stores=["{store.path}"]', "--run.name=ids")
    config.write_text(cfg.to_toml())
    done = run_liandan("train", config, "--nproc=2", env=environment_without(), timeout=300)
    assert done.returncode == 2, done.stderr  # a user error: the supervisor does not retry it
    assert "Traceback" not in done.stderr and "restart" not in done.stdout, done.stderr
    *before, last = done.stderr.strip().splitlines()
    assert last.startswith("liandan: error: token store "), done.stderr
    assert str(store.path) in last and "token id 60000" in last and "vocabulary of 257" in last
    # When the other rank was still joining the process group as this one ended, its failure shows first, as
    # one line that says it is a consequence (gloo's own log line of the closed connection goes to the log).
    assert all("a consequence of another process ending" in line for line in before), done.stderr
    events = (tmp_path / "runs" / "ids" / "events.jsonl").read_text()
    assert '"incident"' not in events and '"restart"' not in events
    [stopped] = read_run(tmp_path / "runs" / "ids").of_kind("train_stopped")  # ended, not left "running"
    assert stopped["cause"] == "user error" and stopped["error"] == last.removeprefix("liandan: error: ")
    listed = run_liandan("runs", tmp_path / "runs")
    assert listed.returncode == 0 and "stopped" in listed.stdout and "running" not in listed.stdout, listed.stdout


@pytest.mark.slow
def test_an_unsupervised_run_that_stops_on_a_user_error_shows_as_stopped(corpus, tmp_path):
    store = _store_with_foreign_ids(tmp_path / "foreign", corpus["alpha"], 60000)
    config = tmp_path / "run.toml"
    cfg = tiny_config(tmp_path / "runs", write_corpus(tmp_path), f'--data.stores=["{store.path}"]', "--run.name=ids",
                      "--resilience.supervise=false")  # fmt: skip
    config.write_text(cfg.to_toml())
    done = run_liandan("train", config, env=environment_without(), timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    [stopped] = read_run(tmp_path / "runs" / "ids").of_kind("train_stopped")
    assert stopped["cause"] == "user error" and stopped["error"] == last.removeprefix("liandan: error: ")
    listed = run_liandan("runs", tmp_path / "runs")
    assert listed.returncode == 0 and "stopped" in listed.stdout and "interrupted" not in listed.stdout, listed.stdout


def test_trainer_trains_on_a_mixture_of_stores_and_resumes(stores, tmp_path):
    from liandan.train import Trainer

    paths = json.dumps([str(s.path) for s in stores[:2]])
    common = [f"--data.stores={paths}", "--data.weights=[0.75, 0.25]", "--train.steps=4", "--checkpoint.every=2",
              "--checkpoint.async_save=false", "--data.val_fraction=0.1", "--train.eval_every=4"]  # fmt: skip
    unused = write_corpus(tmp_path)  # [data] paths is ignored when stores are given
    trainer = Trainer(tiny_config(tmp_path, unused, *common, "--run.name=straight"), say=lambda m: None)
    assert trainer.parts.data.tokenizer.fingerprint() == "byte-v1" and not (trainer.run_dir / "data").exists()
    straight = trainer.train()
    meta = json.loads((trainer.run_dir / "checkpoints" / "step-00000004" / "meta.json").read_text())
    assert meta["tokenizer"] == "byte-v1" and meta["loader"]["step"] == 4
    assert meta["loader"]["weights"] == [0.75, 0.25]

    # Lose the last checkpoint: the run resumes at step 2 and trains steps 3 and 4 on the same batches.
    shutil.rmtree(trainer.run_dir / "checkpoints" / "step-00000004")
    resumed = Trainer(tiny_config(tmp_path, unused, *common, "--run.name=straight"), say=lambda m: None)
    assert resumed.step == 2
    assert resumed.train().losses[-2:] == straight.losses[-2:]


def test_validation_gives_every_rank_as_many_batches_and_nothing_when_nothing_is_held_out(stores):
    """Sharded forwards pair up across ranks, so a rank with one batch more would wait forever: an odd count of
    held-out windows loses one. Stores that hold nothing out give no batches (no loss), not an empty mean."""
    counts = set()
    for fraction in (0.01, 0.012, 0.014, 0.016):
        held_out = len(PackedLoader(stores[:1], 128, 4, seed=0, val_fraction=fraction).streams[0].val_windows)
        counts.add(held_out % 2)
        ranks = [PackedLoader(stores[:1], 128, 4, seed=0, val_fraction=fraction, dp_size=2, dp_rank=rank)
                 for rank in (0, 1)]  # fmt: skip
        batches = [r.validation(n_batches=held_out, batch_size=1) for r in ranks]  # more than there are
        assert len(batches[0]) == len(batches[1]) == held_out // 2, (fraction, held_out)
    assert counts == {0, 1}  # both cases met
    assert PackedLoader(stores, 128, 4, seed=0, val_fraction=0.0).validation(n_batches=2, batch_size=2) == []


def test_a_run_that_holds_nothing_out_reports_no_validation_loss(stores, tmp_path):
    from liandan.train import Trainer

    said = []
    cfg = tiny_config(tmp_path, write_corpus(tmp_path), f'--data.stores=["{stores[0].path}"]', "--train.steps=2",
                      "--data.val_fraction=0", "--train.eval_every=1", "--run.name=none-held-out")  # fmt: skip
    trainer = Trainer(cfg, say=said.append)
    result = trainer.train()
    assert result.val_loss is None  # not 0.0, which reads as a perfect model
    assert not read_run(trainer.run_dir).of_kind("eval")
    assert sum("no validation loss: the token stores hold no window out" in line for line in said) == 1, said
