import cProfile, pstats, sys, time, io, torch
sys.path.insert(0, "bench")
import torchloom
from bench_trainers import _config, _data, _net
dev = torch.device("cuda")
data = _data(60000, 1024, dev)
torch.cuda.synchronize()
for m in ("backprop", "tween", "tp chain"):
    pr = cProfile.Profile(); t = time.perf_counter(); pr.enable()
    r = torchloom.train(_net(dev), data, _config(m, dev, epochs=1)); torch.cuda.synchronize()
    pr.disable(); print("=====", m, time.perf_counter() - t, flush=True)
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(45); print(s.getvalue()[:9000])
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(20); print(s.getvalue()[:5000])
