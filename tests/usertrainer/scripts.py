"""Training scripts as users write them, for the tests of megaheal run with a user's program: plain PyTorch DDP on
gloo, its own checkpoint, its own resume (torchrun's contract: TORCHELASTIC_RESTART_COUNT above 0 means resume)."""

PLAIN_DDP = r'''
import argparse, os, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
p.add_argument("--ckpt", required=True)
p.add_argument("--sleep", type=float, default=0.2)
a = p.parse_args()
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
start = 0
if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and os.path.exists(a.ckpt):
    state = torch.load(a.ckpt)
    model.module.load_state_dict(state["model"]); opt.load_state_dict(state["opt"]); start = state["step"]
print(f"rank {rank}/{world} starts at step {start} restart {os.environ.get('TORCHELASTIC_RESTART_COUNT')}", flush=True)
g = torch.Generator().manual_seed(rank)
for step in range(start, a.steps):
    x = torch.randn(8, 16, generator=g)
    loss = model(x).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    time.sleep(a.sleep)
    if rank == 0 and step % 5 == 4:
        torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step + 1}, a.ckpt + ".tmp")
        os.replace(a.ckpt + ".tmp", a.ckpt)
dist.destroy_process_group()
print(f"rank {rank} done", flush=True)
'''

WITH_API = r'''
import argparse, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import megaheal.rank as mh

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
p.add_argument("--poison-step", type=int, default=-1)
p.add_argument("--poison-rank", type=int, default=1)
a = p.parse_args()
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
mh.watch(model, opt)
g = torch.Generator().manual_seed(rank)
for step in range(a.steps):
    x = torch.randn(8, 16, generator=g)
    if step == a.poison_step and rank == a.poison_rank:
        x[0, 0] = float("nan")  # a corrupt sample in this rank's batch
    loss = model(x).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    time.sleep(0.2)
    mh.step(step, loss=loss.item(), tokens=8)
dist.destroy_process_group()
'''
