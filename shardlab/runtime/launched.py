"""One process of a launcher that starts them all (SLURM's `srun`, Open MPI's `mpirun`):
where process 0 is, the count and id (read by slurm.py and open_mpi.py), and the GPUs it
drives. JAX's own rule gives each process the single GPU of its local index, so one process
per node would drive one GPU of eight."""

import dataclasses
import glob


@dataclasses.dataclass(frozen=True)
class Process:
  coordinator: str  # HOST:PORT of process 0
  num_processes: int
  process_id: int
  local_device_ids: list[int] | None  # None: leave it to JAX (CPU, TPU, JAX_LOCAL_DEVICE_IDS)
  source: str  # where the address came from ("from PMIX_NAMESPACE"), for messages


def visible_gpus(env) -> int:
  """How many GPUs this process sees: CUDA_VISIBLE_DEVICES if set, else the device files."""
  listed = env.get("CUDA_VISIBLE_DEVICES")
  if listed is not None:
    return len([d for d in listed.split(",") if d.strip()])
  return len(glob.glob("/dev/nvidia[0-9]*"))


def gpu_share(gpus: int, processes: int, local: int, own_each: bool = False) -> list[int] | None:
  """The GPUs (of the `gpus` it sees) that process `local` of the `processes` on its node
  drives: all it sees when it is alone there, or when the launcher gave each process its
  own (`own_each`, or fewer GPUs than processes); else an equal share by local index (8
  GPUs, 2 processes: 4 each); None where no equal share exists (JAX's own rule then)."""
  if processes == 1 or own_each or gpus < processes:
    return list(range(gpus))
  if gpus % processes:
    return None
  each = gpus // processes
  return list(range(local * each, (local + 1) * each))
