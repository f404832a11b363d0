"""examples/k8s/jobset-multislice.yaml: its slices, hosts and chips agree with the mesh of the
command it runs, that command parses with train.py's own parser, and the environment it gives
each pod makes shardlab and JAX count and number the processes as docs/multihost.md says."""

import math
import os
import re
from pathlib import Path

import pytest
import yaml
from jax._src.clusters import cloud_tpu_cluster

from shardlab.cli import train
from shardlab.runtime import distributed
from shardlab.sharding import mesh as mesh_lib

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "examples" / "k8s" / "jobset-multislice.yaml"
DOC = ROOT / "docs" / "multihost.md"


@pytest.fixture(scope="module")
def jobset() -> dict:
  return yaml.safe_load(MANIFEST.read_text())


def parts(jobset: dict):
  """(the replicated job, its Job spec, the pod spec, the one container)."""
  [replicated] = jobset["spec"]["replicatedJobs"]
  job = replicated["template"]["spec"]
  pod = job["template"]["spec"]
  [container] = pod["containers"]
  return replicated, job, pod, container


def command_args(container: dict) -> list[str]:
  command = [str(a) for a in container["command"]]
  return command[command.index("train.py") + 1:]


def test_is_a_multislice_jobset(jobset):
  assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and jobset["kind"] == "JobSet"
  annotations = jobset["metadata"]["annotations"]
  assert annotations["alpha.jobset.sigs.k8s.io/exclusive-topology"] == \
      "cloud.google.com/gke-nodepool"
  _, job, pod, _ = parts(jobset)
  assert job["parallelism"] == job["completions"]
  assert pod["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"] == "tpu-v5-lite-podslice"


def test_slices_hosts_and_chips_match_the_mesh(jobset):
  replicated, job, pod, container = parts(jobset)
  slices, hosts, chips = (replicated["replicas"], job["parallelism"],
                          container["resources"]["limits"]["google.com/tpu"])
  topology = pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"]
  assert math.prod(int(n) for n in topology.split("x")) == hosts * chips  # one slice's chips
  args = train.train_parser().parse_args(command_args(container))
  spec = mesh_lib.load(args.mesh)
  assert spec.n_devices == slices * hosts * chips
  assert spec.dcn == {"data": slices}  # one DCN step per slice, nothing else across slices
  cfg = train.config_from_args(args)  # a valid run config: model preset, strategy, precision
  assert (cfg.strategy, cfg.train.precision) == ("fsdp", "bf16")
  assert cfg.checkpoint.dir.startswith(container["volumeMounts"][0]["mountPath"])


def pod_env(jobset: dict, slice_id: int, worker_id: int) -> dict:
  """The environment of one pod: the manifest's variables as Kubernetes resolves them, plus
  the two GKE adds to a multi-host TPU Job."""
  replicated, job, _, container = parts(jobset)
  name, rjob = jobset["metadata"]["name"], replicated["name"]
  fields = {"metadata.annotations['jobset.sigs.k8s.io/jobset-name']": name,
            "metadata.annotations['jobset.sigs.k8s.io/replicatedjob-name']": rjob,
            "metadata.labels['jobset.sigs.k8s.io/replicatedjob-replicas']":
                str(replicated["replicas"]),
            "metadata.labels['jobset.sigs.k8s.io/job-index']": str(slice_id)}
  env = {}
  for var in container["env"]:
    if "valueFrom" in var:
      env[var["name"]] = fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
    else:  # $(X) expands only variables defined above it
      env[var["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], str(var["value"]))
  hosts = [f"{name}-{rjob}-{slice_id}-{i}.{name}" for i in range(job["parallelism"])]
  return {**env, "TPU_WORKER_ID": str(worker_id), "TPU_WORKER_HOSTNAMES": ",".join(hosts)}


def test_pods_number_themselves_as_one_run(jobset, monkeypatch):
  replicated, job, _, _ = parts(jobset)
  slices, hosts = replicated["replicas"], job["parallelism"]
  name, rjob = jobset["metadata"]["name"], replicated["name"]
  for key in [k for k in os.environ if k.startswith(("SHARDLAB_", "SLURM_", "OMPI_", "PMIX_"))]:
    monkeypatch.delenv(key)
  seen = set()
  for slice_id in range(slices):
    for worker in range(hosts):
      for key, value in pod_env(jobset, slice_id, worker).items():
        monkeypatch.setenv(key, value)
      # Every pod agrees on process 0: pod 0 of slice 0, by JobSet's DNS name.
      assert os.environ["MEGASCALE_COORDINATOR_ADDRESS"] == f"{name}-{rjob}-0-0.{name}"
      assert distributed.detected_cluster() == "TPU pod"  # shardlab starts jax.distributed
      cluster = cloud_tpu_cluster.GkeTpuCluster  # what JAX then reads
      assert cluster.get_process_count() == slices * hosts
      seen.add(cluster.get_process_id())
  assert seen == set(range(slices * hosts))


def test_doc_names_the_manifest_and_its_environment(jobset):
  text = DOC.read_text()
  section = text.split("## GKE multi-slice (JobSet)")[1].split("\n## ")[0]
  assert "examples/k8s/jobset-multislice.yaml" in section
  _, _, _, container = parts(jobset)
  named = set(re.findall(r"`(MEGASCALE_[A-Z_]+)`", section))
  assert named and named <= {v["name"] for v in container["env"]}
  args = train.train_parser().parse_args(command_args(container))
  assert f"`{args.mesh}`" in section
