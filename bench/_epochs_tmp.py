import sys, time, torch
sys.path.insert(0, "bench")
import torchloom
from bench_trainers import _config, _data, _net
dev = torch.device("cuda")
for batch in (1024, 128):
    data = _data(60000, batch, dev)
    for m in ("backprop", "tween", "tp chain"):
        net = _net(dev); torch.cuda.synchronize(); t = time.perf_counter()
        r = torchloom.train(net, data, _config(m, dev, epochs=4)); torch.cuda.synchronize()
        print(batch, m, f"total {time.perf_counter()-t:.3f}s epochs", [f"{e:.3f}" for e in r.epoch_times], flush=True)
