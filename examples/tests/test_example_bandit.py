"""The example's phases, EXP3 weights and batch sampling (examples/bandit.py, pipeline.py)."""

import json

import numpy as np
import pytest

from gpt.data import bandit, pipeline

CFG = bandit.BanditConfig(eta=2.0, floor=0.05, smoothing=0.5)


# --- Phases -------------------------------------------------------------------------


def test_phase_lengths_are_the_promised_ones():
  starts = bandit.phase_starts(seed=0, num_steps=5000)
  lengths = np.diff(starts)
  assert starts[0] == 1
  assert set(lengths) <= set(bandit.PHASE_LENGTHS)
  assert set(lengths) == set(bandit.PHASE_LENGTHS)  # all of them occur in 5000 steps
  assert starts[-1] <= 5000


def test_phases_are_a_pure_function_of_the_seed():
  assert bandit.phase_starts(3, 400) == bandit.phase_starts(3, 400)
  assert bandit.phase_starts(3, 400) != bandit.phase_starts(4, 400)
  # A longer run has the same boundaries as a shorter one, then more.
  short, long = bandit.phase_starts(3, 100), bandit.phase_starts(3, 400)
  assert long[:len(short)] == short


# --- Weights ------------------------------------------------------------------------


def test_initial_weights_are_uniform():
  state = bandit.BanditState.initial(3)
  np.testing.assert_array_equal(state.weights, np.full(3, 1 / 3))


@pytest.mark.parametrize("rewards", [
    [0.0, 0.0, 0.0], [9.0, 1.0, 1.0], [1000.0, 0.0, -1000.0], [5.5, 5.0, 4.5]])
def test_weights_are_a_distribution_with_a_floor(rewards):
  weights = bandit.weights_from_rewards(np.array(rewards), CFG)
  assert weights.sum() == pytest.approx(1.0, abs=1e-12)
  assert np.all(weights >= CFG.floor - 1e-12)
  assert np.all(weights > 0)


def test_weights_follow_the_softmax_formula():
  smoothed = np.array([5.5, 5.0, 4.5])
  softmax = np.exp(2.0 * smoothed) / np.exp(2.0 * smoothed).sum()
  expected = (1 - 3 * 0.05) * softmax + 0.05
  np.testing.assert_allclose(bandit.weights_from_rewards(smoothed, CFG), expected)


def test_a_floor_that_leaves_no_room_is_rejected():
  with pytest.raises(ValueError, match="floor"):
    bandit.weights_from_rewards(np.zeros(3), bandit.BanditConfig(floor=0.4))


def test_reward_is_the_importance_weighted_loss_share():
  state = bandit.BanditState.initial(3)
  # 12 rows: 6, 4 and 2 rows with mean losses 5, 6 and 8.
  state = bandit.observe(state, [30.0, 24.0, 16.0], [6, 4, 2])
  new_state, reward = bandit.end_phase(state, CFG)
  np.testing.assert_allclose(reward, [30 / 12 * 3, 24 / 12 * 3, 16 / 12 * 3])
  np.testing.assert_allclose(new_state.smoothed_reward, reward)  # first phase: as is
  np.testing.assert_array_equal(new_state.phase_rows, 0)
  assert new_state.num_updates == 1


def test_the_harder_source_gains_weight_and_none_reaches_zero():
  state = bandit.BanditState.initial(3)
  for _ in range(30):  # source 2 always has the highest loss; source 0 is never drawn
    rows = np.round(state.weights * 100)
    rows[0] = 0
    state = bandit.observe(state, rows * np.array([3.0, 4.0, 7.0]), rows)
    state, _ = bandit.end_phase(state, CFG)
    assert np.all(state.weights >= CFG.floor - 1e-12)
    assert state.weights.sum() == pytest.approx(1.0)
  assert state.weights[2] == state.weights.max() > 0.8


def test_smoothing_mixes_the_new_reward_into_the_old():
  state = bandit.BanditState.initial(2)
  state = bandit.observe(state, [5.0, 5.0], [1, 1])
  state, _ = bandit.end_phase(state, bandit.BanditConfig(floor=0.1))  # R = [5, 5]
  state = bandit.observe(state, [7.0, 3.0], [1, 1])
  state, reward = bandit.end_phase(state, bandit.BanditConfig(floor=0.1, smoothing=0.25))
  np.testing.assert_allclose(reward, [7.0, 3.0])
  np.testing.assert_allclose(state.smoothed_reward, [0.25 * 5 + 0.75 * 7, 0.25 * 5 + 0.75 * 3])


def test_state_round_trips_through_json_exactly():
  state = bandit.BanditState.initial(3)
  state = bandit.observe(state, [1 / 3, 2 / 7, 0.1], [1, 2, 3])
  state, _ = bandit.end_phase(state, CFG)
  state = bandit.observe(state, [np.pi, np.e, 1e-300], [3, 2, 1])
  back = bandit.BanditState.from_json(json.loads(json.dumps(state.to_json())))
  for field in ("weights", "smoothed_reward", "phase_loss_sum", "phase_rows"):
    np.testing.assert_array_equal(getattr(back, field), getattr(state, field))
  assert back.num_updates == state.num_updates


# --- Batches ------------------------------------------------------------------------


def _streams():
  return [np.arange(100, dtype=np.int32), np.arange(1000, 1500, dtype=np.int32),
          np.arange(5000, 5050, dtype=np.int32)]


def _sample(step, weights=(0.2, 0.3, 0.5), seed=0):
  return pipeline.sample_batch(_streams(), np.array(weights), seed=seed, step=step,
                               batch_size=64, context_length=16)


def test_a_batch_is_a_pure_function_of_seed_step_and_weights():
  a, b = _sample(7), _sample(7)
  np.testing.assert_array_equal(a.tokens_BxL1, b.tokens_BxL1)
  np.testing.assert_array_equal(a.source_B, b.source_B)
  assert not np.array_equal(a.tokens_BxL1, _sample(8).tokens_BxL1)
  assert not np.array_equal(a.tokens_BxL1, _sample(7, seed=1).tokens_BxL1)


def test_batch_rows_are_contiguous_windows_of_their_source():
  batch = _sample(3)
  assert batch.tokens_BxL1.shape == (64, 17) and batch.tokens_BxL1.dtype == np.int32
  offsets = np.array([0, 1000, 5000])
  for row, source in zip(batch.tokens_BxL1, batch.source_B):
    np.testing.assert_array_equal(np.diff(row), 1)  # the streams are aranges
    assert offsets[source] <= row[0] and row[-1] < offsets[source] + len(_streams()[source])


def test_sources_are_drawn_by_the_weights():
  counts = np.zeros(3)
  for step in range(1, 51):
    counts += np.bincount(_sample(step, weights=(0.1, 0.6, 0.3)).source_B, minlength=3)
  np.testing.assert_allclose(counts / counts.sum(), [0.1, 0.6, 0.3], atol=0.03)


def test_only_the_rows_asked_for_are_read():
  rows = np.array([1, 2, 5, 6])
  part = pipeline.sample_batch(_streams(), np.array([0.2, 0.3, 0.5]), seed=0, step=4,
                               batch_size=64, context_length=16, rows=rows)
  whole = _sample(4)
  np.testing.assert_array_equal(part.tokens_BxL1, whole.tokens_BxL1[rows])
  np.testing.assert_array_equal(part.source_B, whole.source_B[rows])


def test_prefetcher_yields_the_same_batches_in_order():
  prefetcher = pipeline.Prefetcher(_streams(), seed=0, batch_size=64, context_length=16,
                                   depth=2)
  try:
    prefetcher.start_phase(1, 5, np.array([0.2, 0.3, 0.5]))
    for step in range(1, 10):
      if step == 6:  # a phase boundary: the next weights come once step 5 is done
        assert prefetcher.planned_through == 5
        prefetcher.start_phase(6, 9, np.array([0.6, 0.2, 0.2]))
      tokens, sources = prefetcher.next(step)
      prefetcher.put_ahead(step)
      expected = _sample(step, weights=(0.2, 0.3, 0.5) if step <= 5 else (0.6, 0.2, 0.2))
      np.testing.assert_array_equal(np.asarray(tokens), expected.tokens_BxL1)
      np.testing.assert_array_equal(np.asarray(sources), expected.source_B)
  finally:
    prefetcher.close()


def test_prefetcher_puts_the_next_batch_on_the_device_ahead_of_its_step():
  prefetcher = pipeline.Prefetcher(_streams(), seed=0, batch_size=8, context_length=16)
  try:
    prefetcher.start_phase(1, 3, np.array([0.2, 0.3, 0.5]))
    prefetcher.next(1)
    prefetcher.put_ahead(1)
    assert list(prefetcher._staged) == [2]  # step 2's batch is on the device already
    prefetcher.next(2)
    prefetcher.put_ahead(2)
    prefetcher.next(3)
    prefetcher.put_ahead(3)  # the phase ends here: nothing beyond it is made
    assert not prefetcher._staged and prefetcher.planned_through == 3
  finally:
    prefetcher.close()


def test_prefetcher_closes_while_batches_are_still_queued():
  prefetcher = pipeline.Prefetcher(_streams(), seed=0, batch_size=4, context_length=16,
                                   depth=1)
  prefetcher.start_phase(1, 40, np.array([0.2, 0.3, 0.5]))
  prefetcher.next(1)
  prefetcher.close()  # must not hang on the full queue


def test_a_failure_on_the_sampling_thread_reaches_the_loop():
  prefetcher = pipeline.Prefetcher(_streams(), seed=0, batch_size=4, context_length=16)
  try:
    prefetcher.start_phase(1, 3, np.array([0.5, 0.5]))  # two weights for three sources
    with pytest.raises(RuntimeError, match="batch sampling thread failed"):
      prefetcher.next(1)
  finally:
    prefetcher.close()
