"""The bed's configuration, names and generated files, checked without building anything (no root)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from runbooks.checks.collective import CollectiveBandwidthCheck
from runbooks.checks.collective_srun import rendezvous_port, srun_argv
from runbooks.checks.collective_job import JobSpec
from runbooks.registry import CheckContext
from testbed.bed import Bed
from testbed.cli import parse_rate
from testbed.hostns import hosts_file_text
from testbed.layout import Layout
from testbed.slurm import conf_text

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"prefix": "mh1"}, "prefix must be 1-8 lower-case letters"),
        ({"prefix": "toolongprefix"}, "prefix must be 1-8 lower-case letters"),
        ({"hosts": 0}, r"hosts must be in \[1, 32\]"),
        ({"subnet": "8.8.8.0/24"}, "private IPv4 network"),
        ({"subnet": "10.213.0.1/24"}, "subnet must be an IPv4 network"),
        ({"subnet": "10.213.0.0/29"}, "room for 4 hosts"),
        ({"slurmctld_port": 6818}, "slurmctld_port must be"),
        ({"slurmd_timeout": timedelta(0)}, "slurmd_timeout must be"),
        ({"state_root": "run"}, "state_root must be an absolute path"),
    ],
)
def test_it_refuses_a_bad_config_naming_the_field(changes, message) -> None:
    with pytest.raises(ValueError, match=message):
        Bed.Config(**changes)


def test_it_names_everything_with_the_prefix_and_numbers_addresses_from_the_subnet() -> None:
    layout = Layout.build("mh", 3, "10.213.0.0/24")
    assert [(h.name, h.address, h.veth) for h in layout.hosts] == [
        ("mh1", "10.213.0.11", "mhv1"), ("mh2", "10.213.0.12", "mhv2"), ("mh3", "10.213.0.13", "mhv3")]
    assert (layout.bridge, layout.bridge_address, str(layout.state_dir)) == ("mhbr0", "10.213.0.1", "/run/mh-testbed")
    assert layout.host_pattern().match("mh12") and not layout.host_pattern().match("mht1")
    with pytest.raises(ValueError, match="no host 'mh9'"):
        layout.host("mh9")


def test_its_slurm_conf_and_hosts_file_list_every_host_with_its_address() -> None:
    layout = Layout.build("mh", 2, "10.213.0.0/24")
    conf = conf_text(layout, 2, 6817, timedelta(seconds=10))
    assert "NodeName=mh1 NodeAddr=10.213.0.11 CPUs=2" in conf and "NodeName=mh2 NodeAddr=10.213.0.12" in conf
    assert "AuthInfo=socket=/run/mh-testbed/munge/munge.sock" in conf and "SlurmdTimeout=10" in conf
    assert "PartitionName=mh Nodes=ALL Default=YES" in conf
    hosts = hosts_file_text(layout).splitlines()
    assert "10.213.0.11\tmh1" in hosts and "10.213.0.12\tmh2" in hosts and "127.0.0.1\tlocalhost" in hosts


@pytest.mark.parametrize(("text", "bits"), [("100mbit", 100_000_000), ("1gbit", 10**9), ("500kbit", 500_000),
                                             ("1.5Mbit", 1_500_000), ("8000", 8000)])
def test_it_reads_rates_in_tc_units(text, bits) -> None:
    assert parse_rate(text) == bits


def test_it_refuses_a_rate_it_cannot_read() -> None:
    with pytest.raises(ValueError, match="--rate must be a rate such as 100mbit"):
        parse_rate("fast")


def test_the_srun_launcher_needs_named_hosts_and_places_ranks_in_blocks() -> None:
    check = CollectiveBandwidthCheck()
    config = CollectiveBandwidthCheck.Config(launcher="srun")
    with pytest.raises(ValueError, match="launcher srun needs the hosts"):
        check.validate(config, CheckContext())
    assert check.launcher(CollectiveBandwidthCheck.Config(), CheckContext(nodes=("a", "b"))) in ("local", "srun")
    with pytest.raises(ValueError, match="launcher must be one of"):
        CollectiveBandwidthCheck.Config(launcher="ssh")
    spec = JobSpec(world_size=4, ranks_per_node=2, device="cpu", collectives=["all_reduce"], sizes=[1024], warmup=1,
                   iters=1, budget_s=3.0, pairwise=False, pair_size=1024, pair_repeats=1, timeout=timedelta(seconds=10))
    argv = srun_argv(spec, ["h1", "h2"])
    assert {"--nodes=2", "--ntasks=4", "--ntasks-per-node=2", "--nodelist=h1,h2", "--distribution=block"} <= set(argv)
    assert rendezvous_port(7, 0) != rendezvous_port(7, 1) != rendezvous_port(8, 1)
    assert all(20000 <= rendezvous_port(j, s) < 32768 for j in range(0, 5000, 97) for s in range(4))
