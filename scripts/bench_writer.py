"""Shard-writer throughput without a GPU: sha256 scaling and ShardSink + AsyncShardWriter writing
64 MiB samples (8B-shaped: T=2048, H=4096, bf16) to a disk folder and to /dev/shm with 1, 2, 4 writers.

    python scripts/bench_writer.py
"""
import hashlib, os, shutil, threading, time, torch
from eagle_data.extract.async_sink import AsyncShardWriter
from eagle_data.extract.sink import ShardSink
buf = os.urandom(64 << 20)
def sha(nthreads, reps=8):
    def w():
        for _ in range(reps): hashlib.sha256(buf).digest()
    ts=[threading.Thread(target=w) for _ in range(nthreads)]; t=time.perf_counter()
    [x.start() for x in ts]; [x.join() for x in ts]
    return nthreads*reps*len(buf)/(time.perf_counter()-t)/1e9
for n in (1,2,4): print(f"sha256 {n} threads: {sha(n):.2f} GB/s", flush=True)
T,H=2048,4096
pin = torch.cuda.is_available()
aux=torch.randn(T,3*H).to(torch.bfloat16); fin=torch.randn(T,H).to(torch.bfloat16)
if pin: aux=aux.pin_memory(); fin=fin.pin_memory()
ids=torch.zeros(T,dtype=torch.long); lm=torch.ones(T,dtype=torch.uint8)
for d in ("/tmp/diagw", "/dev/shm/diagw"):
  for nw in (1,2,4):
    shutil.rmtree(d, ignore_errors=True)
    sinks=[ShardSink(d,0,w,max_samples=16,shard_step=nw) for w in range(nw)]
    aw=AsyncShardWriter(sinks, max_queue=8); n=48; t=time.perf_counter()
    for i in range(n):
        aw.put(f"k{i}", {"input_ids":ids,"loss_mask":lm,"aux_hidden_states":aux,"hidden_states":fin}, {"source_id":"x","source_row":i,"num_turns":2,"truncated":False})
    aw.close(); dt=time.perf_counter()-t
    print(f"ShardSink {d} writers={nw}: {n*T*4*H*2/dt/1e9:.2f} GB/s", flush=True)
    shutil.rmtree(d, ignore_errors=True)
