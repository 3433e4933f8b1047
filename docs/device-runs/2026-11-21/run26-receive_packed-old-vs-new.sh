set -u
export PYTHONPATH=$PWD OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
python3 -c "import torch, aiohttp; print(torch.__version__, torch.cuda.nccl.version(), aiohttp.__version__)"
PORT=29517
python3 .devscratch/gpu_packed.py 0 $PORT > $OUT/rank0.log 2>&1 &
P0=$!
timeout 400 python3 .devscratch/gpu_packed.py 1 $PORT 2>&1 | tee $OUT/rank1.log
wait $P0; echo "rank0 rc=$?"; tail -5 $OUT/rank0.log
