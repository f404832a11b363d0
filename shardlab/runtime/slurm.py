"""Inside `srun`: the coordinator, the process count and id, and the GPUs of this task, from
SLURM's environment alone (no `scontrol`: compute nodes may lack it).

JAX has its own SLURM detection; shardlab does this itself because JAX's (0.10) reads only
the first bracket of a node list (`rack[1-2]-gpu[01-04]` gave `rack1`), picks one port per
job id (two `srun` steps of one job, on the same first node, collide), and gives every
task the single GPU [SLURM_LOCALID] (one task per node then drives one GPU of eight).
"""

import re

from shardlab.runtime import launched

# The port range JAX uses for SLURM, above Linux's ephemeral ports (32768-60999 by default),
# so no outgoing connection holds it by chance.
PORT_BASE, PORT_SLOTS = 61440, 4096
STEPS_PER_JOB = 8  # consecutive steps of one job get distinct ports, 8 per job id


Task = launched.Process  # what this launcher tells one of its processes


def in_step(env) -> bool:
  """Whether this process is one task of a multi-task `srun` step. A batch script itself
  has SLURM_NTASKS and SLURM_PROCID too, but no step: one process, not a run of N."""
  return "SLURM_STEP_ID" in env and "SLURM_PROCID" in env and step_tasks(env) > 1


def step_tasks(env) -> int:
  return int(env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", "1")))


def first_host(nodelist: str) -> str:
  """The first host of a SLURM host list: 'gpu[001-004,010],cpu7' -> 'gpu001',
  'rack[1-2]-gpu[01-04]' -> 'rack1-gpu01' (each bracket's first value, zeros kept)."""
  depth, end = 0, len(nodelist)
  for i, ch in enumerate(nodelist):
    depth += {"[": 1, "]": -1}.get(ch, 0)
    if ch == "," and depth == 0:
      end = i
      break
  first = re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m.group(1))[0],
                 nodelist[:end].strip())
  if not first or "[" in first or "]" in first:
    raise ValueError(f"cannot read the first host of the SLURM node list {nodelist!r}")
  return first


def coordinator_port(job_id: int, step_id: int) -> int:
  """Process 0's port: jobs less than 512 ids apart, and the first 8 steps of a job, get
  different ports, so runs that share a first node do not collide."""
  slots = PORT_SLOTS // STEPS_PER_JOB
  return PORT_BASE + (job_id % slots) * STEPS_PER_JOB + step_id % STEPS_PER_JOB


def task(env) -> Task:
  """This task's part in the run, from the environment of an `srun` step. JAX_COORDINATOR_
  ADDRESS (HOST:PORT, as `shardlab launch --slurm` scripts set it) or JAX_COORDINATOR_PORT
  override the derived address."""
  nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "")
  if env.get("JAX_COORDINATOR_ADDRESS"):
    coordinator, source = env["JAX_COORDINATOR_ADDRESS"], "JAX_COORDINATOR_ADDRESS"
  else:
    if env.get("JAX_COORDINATOR_PORT"):
      port, source = int(env["JAX_COORDINATOR_PORT"]), "port from JAX_COORDINATOR_PORT"
    else:
      job, step = int(env["SLURM_JOB_ID"]), int(env["SLURM_STEP_ID"])
      port, source = coordinator_port(job, step), f"port from job {job}, step {step}"
    coordinator = f"{first_host(nodelist)}:{port}"
  return Task(coordinator, step_tasks(env), int(env["SLURM_PROCID"]),
              local_device_ids(env, launched.visible_gpus(env)), source)


def tasks_on_node(env) -> int | None:
  """How many tasks of this step run on this node: SLURM_GTIDS lists their global ids;
  else SLURM_STEP_TASKS_PER_NODE when it is the same on every node ('8(x4)')."""
  if env.get("SLURM_GTIDS"):
    return len(env["SLURM_GTIDS"].split(","))
  counts = {int(re.match(r"\d+", part).group())
            for part in env.get("SLURM_STEP_TASKS_PER_NODE", "").split(",") if part}
  return counts.pop() if len(counts) == 1 else None


def local_device_ids(env, gpus: int) -> list[int] | None:
  """The GPUs (of the `gpus` this task sees) it drives: all of them with one task per node
  or when srun bound GPUs to tasks (--gpus-per-task: each sees only its own); else an
  equal share by SLURM_LOCALID (8 visible, 8 tasks: [LOCALID]; 2 tasks: 4 each)."""
  tasks = tasks_on_node(env)
  if gpus == 0 or "JAX_LOCAL_DEVICE_IDS" in env or tasks is None:
    return None
  return launched.gpu_share(gpus, tasks, int(env.get("SLURM_LOCALID", "0")),
                        own_each=bool(env.get("SLURM_GPUS_PER_TASK")))
