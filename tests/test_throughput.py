"""MFU on CPU: the host's peak is measured once and kept, a step faster than the kept peak
raises it, and MFU is never above 100% (it was, with a peak re-measured in every run on a
loaded host)."""

import json

import jax
import pytest

from shardlab.observe import throughput


@pytest.fixture
def cache(tmp_path, monkeypatch):
  monkeypatch.setenv("SHARDLAB_CACHE_DIR", str(tmp_path))
  return tmp_path / throughput.CPU_PEAK_FILE


def test_the_cpu_peak_is_measured_once_per_host_and_kept(cache, monkeypatch):
  monkeypatch.setattr(throughput, "measure_cpu_matmul", lambda: 8e10)
  rates = throughput.for_run(1e9, 8)
  assert rates.peak_per_device == pytest.approx(8e10 / jax.local_device_count())
  assert json.loads(cache.read_text()) == {throughput.host_key(): 8e10}

  def measure_again():
    raise AssertionError("measured again although the host's peak is kept")

  monkeypatch.setattr(throughput, "measure_cpu_matmul", measure_again)
  again = throughput.for_run(1e9, 8)
  assert again.peak_per_device == rates.peak_per_device and "kept in" in again.peak_source


def test_a_step_faster_than_the_peak_raises_it_and_mfu_stays_at_most_one(cache, monkeypatch):
  monkeypatch.setattr(throughput, "measure_cpu_matmul", lambda: 8e9)
  per_device = 8e9 / jax.local_device_count()
  rates = throughput.for_run(per_device * 8, 8)  # 1 s a step at the peak
  assert rates.record(2.0)["mfu"] == pytest.approx(0.5)
  fast = rates.record(0.5)  # twice the kept peak: the peak was low
  assert fast["mfu"] == pytest.approx(1.0)
  assert rates.record(1.0)["mfu"] == pytest.approx(0.5)  # measured against the raised peak
  assert json.loads(cache.read_text())[throughput.host_key()] == pytest.approx(16e9)


def test_a_datasheet_peak_is_not_raised(cache):
  h100 = throughput.Throughput(1e15, 1, 989e12, "h100-80g dense bf16 peak")
  assert h100.record(1.0)["mfu"] == pytest.approx(1e15 / 989e12)
  assert h100.peak_per_device == 989e12 and not cache.exists()


def test_an_unreadable_or_torn_cache_is_measured_again(cache, monkeypatch):
  cache.write_text("{not json")
  monkeypatch.setattr(throughput, "measure_cpu_matmul", lambda: 5e9)
  peak, where = throughput.cpu_peak()
  assert peak == 5e9 and where == "measured now"
  assert json.loads(cache.read_text()) == {throughput.host_key(): 5e9}
