"""Whether this host has a GPU or TPU, without importing JAX: an entry point asks before it
imports anything heavy (host_memory.cpu_entry_point)."""

import glob
import os


def accelerator_present() -> bool:
  """Whether a GPU or TPU is attached, judged from device files so no backend starts
  (libtpu alone is no evidence: it is installed on CPU machines to compile for TPUs)."""
  if os.environ.get("JAX_PLATFORMS", "").strip() == "cpu":
    return False
  return any(glob.glob(pattern) for pattern in ("/dev/nvidia[0-9]*", "/dev/accel[0-9]*",
                                                "/dev/vfio/[0-9]*"))
