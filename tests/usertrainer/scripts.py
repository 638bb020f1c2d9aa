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
p.add_argument("--raise-at", type=int, default=-1, help="every rank raises at this step (a bug in the program)")
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
    if step == a.raise_at:
        raise ValueError(f"step {step}: the batch does not fit the model")
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
p.add_argument("--width", type=int, default=0, help="hidden layers of this width (0: one linear layer)")
p.add_argument("--batch", type=int, default=8)
p.add_argument("--sleep", type=float, default=0.2)
a = p.parse_args()
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
layers = [torch.nn.Linear(16, 1)] if not a.width else [
    torch.nn.Linear(16, a.width), torch.nn.ReLU(), torch.nn.Linear(a.width, a.width), torch.nn.ReLU(),
    torch.nn.Linear(a.width, 1)]
model = DDP(torch.nn.Sequential(*layers))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
mh.watch(model, opt)
g = torch.Generator().manual_seed(rank)
for step in range(a.steps):
    x = torch.randn(a.batch, 16, generator=g)
    if step == a.poison_step and rank == a.poison_rank:
        x[0, 0] = float("nan")  # a corrupt sample in this rank's batch
    loss = model(x).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    time.sleep(a.sleep)
    mh.step(step, loss=loss.item(), tokens=a.batch)
dist.destroy_process_group()
'''

LIGHTNING = r'''
import argparse, os, time
import torch, pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset
import megaheal.rank as mh
from megaheal.rank.lightning import MegahealCallback

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=30)
p.add_argument("--ckpt-dir", required=True)
p.add_argument("--poison-step", type=int, default=-1)
p.add_argument("--poison-attempt", type=int, default=-1)
a = p.parse_args()
poison = a.poison_step if mh.restart_count() == a.poison_attempt else -1


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        if self.global_step == poison and self.global_rank == 1:
            x = x.clone()
            x[0, 0] = float("nan")  # a corrupt sample in this rank's batch
        time.sleep(0.2)
        return self.layer(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


world, local = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
torch.manual_seed(0)
data = DataLoader(TensorDataset(torch.randn(8 * world * a.steps, 16)), batch_size=8)
ckpt = ModelCheckpoint(dirpath=a.ckpt_dir, filename="{step}", every_n_train_steps=5, save_last=True, save_top_k=-1)
trainer = pl.Trainer(accelerator="cpu", devices=local, num_nodes=world // local, strategy="ddp", max_steps=a.steps,
                     callbacks=[MegahealCallback(), ckpt], enable_progress_bar=False, logger=False,
                     enable_model_summary=False, enable_checkpointing=True)
if mh.resume_step() is not None:  # a rollback: megaheal names the checkpoint (one the callback said was saved)
    resume = os.path.join(a.ckpt_dir, f"step={mh.resume_step()}.ckpt")
else:
    resume = "last" if mh.restart_count() > 0 and os.path.exists(os.path.join(a.ckpt_dir, "last.ckpt")) else None
print(f"rank {trainer.global_rank} restart {mh.restart_count()} resumes from {resume}", flush=True)
trainer.fit(Net(), data, ckpt_path=resume)
print(f"rank {trainer.global_rank} done at step {trainer.global_step}", flush=True)
'''

HUGGINGFACE = r'''
import argparse, glob, os, time
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
import megaheal.rank as mh
from megaheal.rank.huggingface import MegahealCallback

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=30)
p.add_argument("--out", required=True)
p.add_argument("--poison-step", type=int, default=-1)
p.add_argument("--poison-attempt", type=int, default=-1)
a = p.parse_args()
poison = a.poison_step if mh.restart_count() == a.poison_attempt else -1
rank = int(os.environ["RANK"])


class Samples(torch.utils.data.Dataset):
    def __len__(self):
        return 10_000

    def __getitem__(self, i):
        ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


class Slow(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        time.sleep(0.2)


class Poisoned(Trainer):
    def training_step(self, model, inputs, *rest, **kw):
        if self.state.global_step == poison and rank == 1:
            with torch.no_grad():  # a corrupted weight on this rank, as a flipped bit would leave it
                self.model.transformer.wte.weight[0, 0] = float("nan")
        return super().training_step(model, inputs, *rest, **kw)


torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2))
args = TrainingArguments(output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=4, learning_rate=1e-3,
                         logging_steps=1, save_steps=5, save_strategy="steps", report_to=[], use_cpu=True,
                         ddp_backend="gloo", disable_tqdm=True, dataloader_num_workers=0)
trainer = Poisoned(model=model, args=args, train_dataset=Samples(), callbacks=[MegahealCallback(), Slow()])
if mh.resume_step() is not None:  # a rollback: megaheal names the checkpoint (one the callback said was saved)
    resume = os.path.join(a.out, f"checkpoint-{mh.resume_step()}")
else:
    resume = mh.restart_count() > 0 and bool(glob.glob(os.path.join(a.out, "checkpoint-*")))
print(f"rank {rank} restart {mh.restart_count()} resumes {resume}", flush=True)
trainer.train(resume_from_checkpoint=resume or None)
print(f"rank {rank} done at step {trainer.state.global_step}", flush=True)
'''

RESTARTABLE = r'''
import argparse, os, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import megaheal.rank as mh

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
a = p.parse_args()


@mh.restartable
def train(r: mh.Restart) -> int:
    model = r.kept.get("model") or torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = r.kept.get("opt") or torch.optim.SGD(model.parameters(), lr=0.01)
    step = torch.tensor([r.kept.get("step", 0)])
    if r.source is not None:  # a survivor's state for everyone: the new rank takes it, the others agree on it
        for t in [*model.state_dict().values(), step]:
            dist.broadcast(t, r.source)
    print(f"rank {r.rank} pid {os.getpid()} generation {r.generation} source {r.source} step {int(step)}", flush=True)
    ddp = DDP(model, init_sync=False)
    g = torch.Generator().manual_seed(r.rank * 1000 + int(step))
    for s in range(int(step), a.steps):
        loss = ddp(torch.randn(8, 16, generator=g)).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        r.kept.update(model=model, opt=opt, step=s + 1)
        mh.step(s, loss=loss.item())
        time.sleep(0.2)
    return a.steps


done = train()
print(f"rank {dist.get_rank() if dist.is_initialized() else '?'} finished {done} steps", flush=True)
'''

PLAIN_FSDP2 = r'''
import argparse, os, time
import torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import fully_shard

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
p.add_argument("--ckpt", required=True)
p.add_argument("--sleep", type=float, default=0.2)
p.add_argument("--raise-at-resume", type=int, default=-1,
               help="every rank of an attempt that resumed raises at this step (a bug in the resume path)")
a = p.parse_args()
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer)
fully_shard(model)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
start = 0
latest = os.path.join(a.ckpt, "latest")
if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and os.path.exists(latest):
    start = int(open(latest).read())
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=os.path.join(a.ckpt, f"step-{start}"))  # resharded to this world size
    model.load_state_dict(state["model"])
print(f"rank {rank}/{world} starts at step {start} restart {os.environ.get('TORCHELASTIC_RESTART_COUNT')}", flush=True)
g = torch.Generator().manual_seed(rank)
for step in range(start, a.steps):
    if start > 0 and step == a.raise_at_resume:
        raise ValueError(f"step {step}: the resumed optimizer state does not match the model")
    loss = model(torch.randn(8, 16, generator=g)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    time.sleep(a.sleep)
    if step % 5 == 4:
        dcp.save({"model": model.state_dict()}, checkpoint_id=os.path.join(a.ckpt, f"step-{step + 1}"))
        if rank == 0:
            with open(latest + ".tmp", "w") as f:
                f.write(str(step + 1))
            os.replace(latest + ".tmp", latest)
dist.destroy_process_group()
print(f"rank {rank} done", flush=True)
'''
