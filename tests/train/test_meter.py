"""PhaseClock (train/meter.py): where a run's wall time went, printed at its end."""

from train import meter
from train.meter import PhaseClock


def test_laps_charge_the_time_since_the_last_one_and_add_up_by_name(monkeypatch):
    now = iter([0.0, 65.0, 70.0, 190.0, 200.0])
    monkeypatch.setattr(meter.time, "monotonic", lambda: next(now))
    clock = PhaseClock()  # t = 0
    clock.lap("data")  # 65 s
    clock.lap("features")  # 5 s
    clock.lap("data")  # 120 s more: a second lap of the same name adds up
    assert clock.phases == {"data": 185.0, "features": 5.0}
    assert clock.summary() == "wall time: data 3:05, features 0:05; total 3:20"
