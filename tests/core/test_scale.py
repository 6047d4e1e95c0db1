"""LossScale: each rule's trajectory worked out by hand from its pseudo-code, plus the extras."""

from __future__ import annotations

import copy
import logging
import pickle
import random

import pytest
import torch

from fp16kit.core.scale import LossScale, ScaleState
from fp16kit.core.scale_rules import ApexAmpRule, ApexRule, TorchRule

INF, OK = True, False


def run(ls: LossScale, overflows: list[bool]) -> tuple[list[float], list[int]]:
    if not ls.is_materialized:
        ls.materialize("cpu")
    scales, trackers = [], []
    for o in overflows:
        ls.update(torch.tensor(1.0 if o else 0.0))
        scales.append(ls.get_scale())
        trackers.append(ls.get_growth_tracker())
    return scales, trackers


# ---------------------------------------------------------------- torch rule
def test_torch_rule_by_hand():
    ls = LossScale(8.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=2)
    scales, trackers = run(ls, [OK, OK, INF, OK, INF, OK, OK])
    assert scales == [8, 16, 8, 8, 4, 4, 8]
    assert trackers == [1, 0, 0, 1, 0, 1, 0]


def test_torch_rule_never_grows_to_inf():
    ls = LossScale(2.0**127, growth_interval=1)
    scales, trackers = run(ls, [OK, OK])
    assert scales == [2.0**127, 2.0**127]
    assert trackers == [0, 0]  # the tracker still resets at the interval


def test_torch_rule_rounds_products_in_double_like_torch():
    # 0.3 is not a float32 number: torch's kernel multiplies float scale by double factor and
    # rounds once. Reference: torch's own op.
    ls = LossScale(1000.0, growth_factor=3.0, backoff_factor=0.3, growth_interval=1, max_scale=1e30)
    ref_scale = torch.tensor(1000.0)
    ref_tracker = torch.tensor(0, dtype=torch.int32)
    ls.materialize("cpu")
    for o in [INF, OK, INF, INF, OK, OK, INF]:
        found = torch.tensor(1.0 if o else 0.0)
        torch._amp_update_scale_(ref_scale, ref_tracker, found, 3.0, 0.3, 1)
        ls.update(found)  # generic path (max_scale set), must still match bit for bit
        assert torch.equal(ls.scale, ref_scale)
        assert torch.equal(ls.growth_tracker, ref_tracker)


@pytest.mark.parametrize("seed", range(5))
def test_generic_path_matches_fused_torch_op(seed):
    rng = random.Random(seed)
    gf, bf, gi = rng.choice([2.0, 3.0, 1.5]), rng.choice([0.5, 0.3, 0.9]), rng.randint(1, 4)
    fast = LossScale(rng.choice([1.0, 65536.0, 3.7e37]), growth_factor=gf, backoff_factor=bf, growth_interval=gi)
    slow = LossScale(fast.init_scale, growth_factor=gf, backoff_factor=bf, growth_interval=gi)
    fast.materialize("cpu")
    slow.materialize("cpu")
    assert TorchRule().fuses(fast)
    seq = [rng.random() < 0.3 for _ in range(200)]
    for o in seq:
        found = torch.tensor(1.0 if o else 0.0)
        fast.update(found)
        slow._update_generic(found != 0)
        assert torch.equal(fast.scale, slow.scale)
        assert torch.equal(fast.growth_tracker, slow.growth_tracker)


def test_hysteresis_backs_off_only_after_n_overflows_since_growth():
    ls = LossScale(16.0, hysteresis=2, growth_interval=3)
    scales, _ = run(ls, [INF, INF, INF, OK, OK, OK, INF, OK, INF])
    # 1st overflow tolerated; 2nd and 3rd back off; growth refills the hysteresis; then again
    # one overflow is tolerated and the next backs off.
    assert scales == [16, 8, 4, 4, 4, 8, 8, 8, 4]


def test_hysteresis_one_is_torch():
    a = LossScale(64.0, growth_interval=2)
    b = LossScale(64.0, growth_interval=2, hysteresis=1, max_scale=1e30)  # generic path
    seq = [INF, OK, OK, INF, INF, OK, OK, OK, OK, INF]
    assert run(a, seq) == run(b, seq)


def test_min_and_max_scale():
    ls = LossScale(4.0, min_scale=1.0)
    assert run(ls, [INF, INF, INF, INF])[0] == [2, 1, 1, 1]
    ls = LossScale(4.0, growth_interval=1, max_scale=10.0)
    assert run(ls, [OK, OK, OK])[0] == [8, 10, 10]


# ---------------------------------------------------------------- apex rule (fp16_utils)
def test_apex_rule_by_hand():
    # apex: if overflow: scale = max(scale/f, 1); last = cur
    #       elif (cur - last) % window == 0: scale *= f
    #       cur += 1
    ls = LossScale(8.0, rule="apex", growth_factor=2.0, growth_interval=3)
    scales, trackers = run(ls, [OK, OK, OK, INF, OK, OK, OK, OK, OK, OK])
    assert scales == [8, 8, 16, 8, 8, 8, 16, 16, 16, 32]
    # tracker == cur_iter - last_overflow_iter - 1: not reset by growth (a modulo rule)
    assert trackers == [1, 2, 3, 0, 1, 2, 3, 4, 5, 6]


def test_apex_rule_floor_is_one():
    ls = LossScale(2.0, rule="apex")
    assert run(ls, [INF, INF, INF])[0] == [1, 1, 1]
    assert ls.min_scale == 1.0


def test_apex_rule_float64_is_python_float_arithmetic():
    ls = LossScale(2.0**32, rule="apex", growth_factor=3.0, growth_interval=2, dtype=torch.float64, device="cpu")
    expected = float(2**32)
    cur_iter, last = 0, -1
    for o in [INF, INF, OK, OK, OK, OK, INF, OK]:
        if o:
            expected = max(expected / 3.0, 1)
            last = cur_iter
        elif (cur_iter - last) % 2 == 0:
            expected *= 3.0
        cur_iter += 1
        ls.update(o)
        assert ls.get_scale() == expected


def test_apex_rule_has_no_cap():
    ls = LossScale(2.0**1022, rule="apex", growth_interval=1, dtype=torch.float64)
    assert run(ls, [OK, OK])[0] == [2.0**1023, float("inf")]  # as Python floats did


def test_apex_rule_needs_a_window():
    with pytest.raises(ValueError, match="scale_window must be an int >= 1"):
        LossScale(rule="apex", growth_interval=0)


# ---------------------------------------------------------------- apex_amp rule (era 2)
def test_apex_amp_rule_by_hand():
    ls = LossScale(2.0**16, rule="apex_amp", growth_interval=2, max_scale=2.0**24)
    assert run(ls, [OK, OK, INF, OK, OK])[0] == [65536, 131072, 65536, 65536, 131072]


def test_apex_amp_bounds():
    ls = LossScale(2.0**24, rule="apex_amp", growth_interval=1, max_scale=2.0**24)
    assert run(ls, [OK, OK])[0] == [2.0**24, 2.0**24]
    ls = LossScale(2048.0, rule="apex_amp", min_scale=1024.0, max_scale=2.0**24)
    assert run(ls, [INF, INF])[0] == [1024, 1024]
    ls = LossScale(1.0, rule="apex_amp", min_scale=0, max_scale=2.0**24)  # 0 means no floor
    assert ls.min_scale is None
    assert run(ls, [INF])[0] == [0.5]


def test_apex_amp_checks_growth_after_an_overflow_too():
    # apex checked `unskipped == scale_seq_len` after either branch: with a window of 0 an
    # overflow halves the scale and at once doubles it back.
    ls = LossScale(64.0, rule="apex_amp", growth_interval=0, max_scale=2.0**24)
    assert run(ls, [INF])[0] == [64]


# ---------------------------------------------------------------- floor policy
def test_floor_policy_raise():
    ls = LossScale(2.0, min_scale=1.0, on_min_scale="raise", device="cpu")
    ls.update(True)  # 2 -> 1: reached the floor, no overflow *at* the floor yet
    with pytest.raises(FloatingPointError, match="loss is probably exploding"):
        ls.update(True)
    assert ls.get_scale() == 1.0  # the update itself completed
    ls.update(False)  # reported once; training may go on if the caller chooses


def test_floor_policy_warn(caplog):
    ls = LossScale(1.0, min_scale=1.0, on_min_scale="warn", device="cpu")
    with caplog.at_level(logging.WARNING, logger="fp16kit"):
        ls.update(True)
        ls.update(False)
        ls.update(True)
    msgs = [r.getMessage() for r in caplog.records if r.name == "fp16kit"]
    assert len(msgs) == 2 and all("min_scale=1" in m for m in msgs)


def test_floor_policy_needs_a_floor():
    with pytest.raises(ValueError, match="also pass min_scale"):
        LossScale(on_min_scale="raise")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"rule": "jmp"}, "rule must be one of"),
        ({"hysteresis": 0}, "hysteresis must be an int >= 1"),
        ({"hysteresis": 1.5}, "hysteresis must be an int >= 1"),
        ({"min_scale": -1.0}, "min_scale must be None or a finite number"),
        ({"max_scale": float("nan")}, "max_scale must be None or a finite number"),
        ({"min_scale": 8.0, "max_scale": 4.0}, "above max_scale"),
        ({"on_min_scale": "panic"}, "on_min_scale must be one of"),
        ({"dtype": torch.float16}, "dtype must be torch.float32 or torch.float64"),
    ],
)
def test_bad_settings_name_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossScale(**kwargs)


# ---------------------------------------------------------------- counters and reads
def test_skip_counters_and_last_found_inf():
    ls = LossScale(device="cpu")
    assert ls.last_found_inf() is None
    for o in [INF, INF, OK, INF]:
        ls.update(o)
    assert ls.skipped_steps() == 3
    assert ls.consecutive_skipped_steps() == 1
    assert ls.last_found_inf().dtype == torch.bool and bool(ls.last_found_inf())
    ls.update(OK)
    assert ls.consecutive_skipped_steps() == 0 and not bool(ls.last_found_inf())


def test_update_before_materialize_names_the_fix():
    with pytest.raises(RuntimeError, match=r"call materialize\(device\) first"):
        LossScale().update(True)


def test_found_inf_any_device_and_value():
    ls = LossScale(8.0, device="cpu")
    ls.update(torch.tensor(3.0))  # several optimizers' flags summed: still "overflow"
    assert ls.get_scale() == 4.0


# ---------------------------------------------------------------- checkpoints
def test_state_dict_round_trip_is_plain_data(tmp_path):
    ls = LossScale(64.0, hysteresis=3, min_scale=2.0, growth_interval=2, device="cpu")
    run(ls, [INF, OK, INF, OK])
    sd = ls.state_dict()
    torch.save(sd, tmp_path / "ls.pt")
    loaded = torch.load(tmp_path / "ls.pt", weights_only=True)
    other = LossScale(device="cpu")
    other.load_state_dict(loaded)
    assert other.state_dict() == sd
    seq = [OK, INF, INF, OK, OK, INF]
    assert run(ls, seq) == run(other, seq)


def test_load_state_dict_rejects_mismatch_and_changes_nothing():
    ls = LossScale(32.0, device="cpu")
    before = ls.state_dict()
    bad = dict(before)
    del bad["growth_tracker"]
    bad["extra"] = 1
    with pytest.raises(ValueError, match=r"missing keys \['growth_tracker'\]; unknown keys \['extra'\]"):
        ls.load_state_dict(bad)
    with pytest.raises(ValueError, match="rule='apex'"):
        ls.load_state_dict({**before, "rule": "apex"})
    with pytest.raises(ValueError, match="hysteresis must be"):
        ls.load_state_dict({**before, "hysteresis": 0, "scale": 1.0})
    assert ls.state_dict() == before


def test_pickle_keeps_values_and_recreates_tensors_lazily():
    ls = LossScale(16.0, hysteresis=2, device="cpu")
    run(ls, [INF, OK])
    clone = pickle.loads(pickle.dumps(ls))
    assert clone.scale is None
    assert clone.get_scale() == ls.get_scale()
    assert clone.skipped_steps() == 1
    clone.materialize("cpu")
    assert clone.state_dict() == ls.state_dict()


def test_lazy_state_reads_host_values():
    ls = LossScale(5.0)
    assert not ls.is_materialized and ls.device is None
    assert ls.get_scale() == 5.0 and ls.get_growth_tracker() == 0
    ls.set_scale(7.0)
    ls.set_growth_tracker(3)
    ls.materialize("cpu")
    assert ls.get_scale() == 7.0 and ls.get_growth_tracker() == 3
    ls.materialize("cpu")  # idempotent
    assert ls.get_scale() == 7.0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_update_and_floor_report_without_sync():
    ls = LossScale(1.0, min_scale=1.0, on_min_scale="warn", device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            ls.update(torch.ones((), device="cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert ls.get_scale() == 1.0


def test_initial_scale_starts_inside_the_bounds():
    assert LossScale(65536.0, max_scale=1024.0).get_scale() == 1024.0
    assert LossScale(0.5, min_scale=1.0).get_scale() == 1.0
    assert LossScale(2.0**30, rule="apex_amp").get_scale() == 2.0**24  # apex: min(max, init)
    assert LossScale(0.25, rule="apex").get_scale() == 0.25  # apex's era-1 scaler: as told
    ls = LossScale(8.0, max_scale=16.0, device="cpu")
    ls.set_scale(1e9)  # an explicit value is taken as it is
    assert ls.get_scale() == 1e9


def test_apex_amp_caps_at_2_pow_24_by_default():
    ls = LossScale(2.0**24, rule="apex_amp", growth_interval=1, device="cpu")
    ls.update(False)
    assert ls.get_scale() == 2.0**24
    uncapped = LossScale(2.0**24, rule="apex_amp", growth_interval=1, max_scale=float("inf"), device="cpu")
    uncapped.update(False)
    assert uncapped.max_scale is None and uncapped.get_scale() == 2.0**25


def test_load_state_dict_checks_values_before_assigning():
    ls = LossScale(32.0, device="cpu")
    before = ls.state_dict()
    for key, bad in [("scale", "oops"), ("growth_tracker", 1.5), ("growth_factor", None)]:
        with pytest.raises(ValueError, match=key):
            ls.load_state_dict({**before, "growth_factor": 7.0, key: bad})
        assert ls.state_dict() == before


@pytest.mark.parametrize("query_every", [0, 1, 7, 64])
def test_skip_counters_over_many_updates(query_every):
    # The counters fold the recorded flags in batches: any pattern and any query rhythm
    # (querying folds early) must give the plain running counts.
    rng = random.Random(query_every)
    pattern = [rng.random() < 0.3 for _ in range(150)] + [True] * 140 + [False, True]
    ls = LossScale(2.0**16, device="cpu", min_scale=1.0)
    skipped = consecutive = 0
    for i, overflow in enumerate(pattern):
        ls.update(torch.tensor(float(overflow)))
        skipped += overflow
        consecutive = consecutive + 1 if overflow else 0
        assert bool(ls.last_found_inf()) == overflow
        if query_every and i % query_every == 0:
            assert (ls.skipped_steps(), ls.consecutive_skipped_steps()) == (skipped, consecutive)
    assert (ls.skipped_steps(), ls.consecutive_skipped_steps()) == (skipped, consecutive)
    clone = pickle.loads(pickle.dumps(ls))
    assert (clone.skipped_steps(), clone.consecutive_skipped_steps()) == (skipped, consecutive)


def test_skip_counters_are_exact_while_another_thread_updates():
    # GradScaler's update may run on the optimizer thread while the main thread reads.
    import threading

    ls = LossScale(2.0**16, device="cpu", min_scale=1.0)
    pattern = [i % 3 == 0 for i in range(1000)]

    def updates():
        for overflow in pattern:
            ls.update(torch.tensor(float(overflow)))

    worker = threading.Thread(target=updates)
    worker.start()
    while worker.is_alive():
        ls.skipped_steps()
        ls.consecutive_skipped_steps()
    worker.join()
    assert ls.skipped_steps() == sum(pattern)
    assert ls.consecutive_skipped_steps() == 1  # 999 % 3 == 0


# ---------------------------------------------------------------- the device record
def test_pickling_drops_the_device_record_as_a_unit():
    ls = LossScale(16.0, hysteresis=2, min_scale=1.0, on_min_scale="warn", device="cpu")
    run(ls, [INF, OK, INF, INF])
    state = ls.__getstate__()
    assert state["_device_state"] == ScaleState()  # every field empty: nothing device-side left
    assert not any(isinstance(v, torch.Tensor) for v in state.values())
    assert (state["init_scale"], state["init_growth_tracker"], state["init_hysteresis_tracker"]) == (
        ls.get_scale(),
        ls.get_growth_tracker(),
        ls.get_hysteresis_tracker(),
    )
    assert (state["_init_skipped"], state["_init_consecutive"]) == (3, 2)
    assert ls.is_materialized  # pickling did not touch the original


def test_copy_shares_no_tensor_and_rebuilds_the_whole_record():
    ls = LossScale(16.0, device="cpu")
    run(ls, [INF, OK])
    dup = copy.copy(ls)
    assert not dup.is_materialized and dup.last_found_inf() is None
    assert dup.skipped_steps() == 1 and dup.get_scale() == 8.0
    dup.materialize("cpu")
    assert dup.scale is not ls.scale and dup.growth_tracker is not ls.growth_tracker
    dup.update(True)
    assert ls.get_scale() == 8.0 and dup.get_scale() == 4.0
    assert (ls.skipped_steps(), dup.skipped_steps()) == (1, 2)


def test_tensor_attributes_can_be_assigned_as_in_torch():
    # torch's GradScaler code assigns _scale/_growth_tracker (views of these) directly
    ls = LossScale(8.0)
    tracker = torch.tensor(5, dtype=torch.int32)
    ls.growth_tracker = tracker
    assert ls.growth_tracker is tracker and ls.get_growth_tracker() == 5 and not ls.is_materialized
    scale = torch.tensor(4.0)
    ls.scale = scale
    assert ls.scale is scale and ls.is_materialized and ls.device == torch.device("cpu")
    ls.materialize("cpu")  # an assigned scale counts: nothing is rebuilt
    assert ls.scale is scale and ls.growth_tracker is tracker

    ls = LossScale(8.0, device="cpu")
    mine = torch.tensor(2.0)
    ls.scale = mine
    ls.update(False)  # updates the assigned tensor in place
    assert ls.scale is mine and ls.get_scale() == 2.0 and ls.get_growth_tracker() == 1


def test_settings_assigned_after_construction_apply_at_the_next_update():
    ls = LossScale(8.0, growth_interval=4, device="cpu")
    ls.growth_interval, ls.growth_factor, ls.backoff_factor = 1, 3.0, 0.25
    ls.update(False)
    assert ls.get_scale() == 24.0
    ls.update(True)
    assert ls.get_scale() == 6.0


def test_each_rule_name_picks_its_rule_object_and_stays_a_string():
    for name, cls in [("torch", TorchRule), ("apex", ApexRule), ("apex_amp", ApexAmpRule)]:
        ls = LossScale(rule=name)
        assert ls.rule == name and type(ls._rule) is cls
        assert ls.state_dict()["rule"] == name


# A LossScale pickled by fp16kit before its device state was one record (commit f9d784f):
# 16.0, hysteresis=2, min_scale=1.0, on_min_scale="warn", after updates INF, OK, INF, INF.
_OLD_PICKLE = (
    b"\x80\x04\x95`\x02\x00\x00\x00\x00\x00\x00\x8c\x12fp16kit.core.scale\x94\x8c\tLossSc"
    b"ale\x94\x93\x94)\x81\x94}\x94(\x8c\x04rule\x94\x8c\x05torch\x94\x8c\rgrowth_fact"
    b"or\x94G@\x00\x00\x00\x00\x00\x00\x00\x8c\x0ebackoff_factor\x94G?\xe0\x00\x00\x00\x00\x00\x00\x8c\x0f"
    b"growth_interval\x94M\xd0\x07\x8c\nhysteresis\x94K\x02\x8c\tmin_"
    b"scale\x94G?\xf0\x00\x00\x00\x00\x00\x00\x8c\tmax_scale\x94N\x8c\x0con_min_sca"
    b"le\x94\x8c\x04warn\x94\x8c\x05dtype\x94\x8c\x05torch\x94\x8c\x07float32\x94\x93\x94\x8c\n"
    b"init_scale\x94G@\x10\x00\x00\x00\x00\x00\x00\x8c\x13init_growth_tracke"
    b"r\x94K\x00\x8c\x17init_hysteresis_tracker\x94K\x00\x8c\r_init_"
    b"skipped\x94K\x03\x8c\x11_init_consecutive\x94K\x02\x8c\x05scale\x94"
    b"N\x8c\x0egrowth_tracker\x94N\x8c\x12hysteresis_tracker\x94"
    b"N\x8c\x08_skipped\x94N\x8c\x0c_consecutive\x94N\x8c\x08_history\x94"
    b"N\x8c\x06_slots\x94]\x94\x8c\t_recorded\x94K\x00\x8c\n_last_slot\x94N"
    b"\x8c\x0b_count_lock\x94N\x8c\x0b_floor_hits\x94N\x8c\r_floor_r"
    b"eader\x94h\x00\x8c\r_LaggedReader\x94\x93\x94)\x81\x94}\x94\x8c\x08_pendin"
    b"g\x94\x8c\x0bcollections\x94\x8c\x05deque\x94\x93\x94)R\x94sb\x8c\x14_floor_"
    b"hits_reported\x94K\x00ub."
)


def test_unpickles_a_loss_scale_pickled_before_the_record():
    ls = pickle.loads(_OLD_PICKLE)
    assert not ls.is_materialized and ls.scale is None and ls.last_found_inf() is None
    assert (ls.get_scale(), ls.get_hysteresis_tracker(), ls.skipped_steps(), ls.consecutive_skipped_steps()) == (
        4.0,
        0,
        3,
        2,
    )
    assert not ({"scale", "_skipped", "_floor_reader", "_count_lock"} & set(vars(ls)))
    ls.materialize("cpu")
    ls.update(True)
    assert (ls.get_scale(), ls.skipped_steps(), ls.consecutive_skipped_steps()) == (2.0, 4, 3)
