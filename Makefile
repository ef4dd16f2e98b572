# ddp_avg_hooks: `make demo` runs the main job, `make test` the whole suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel of torch; override for another build, e.g. make TORCH_SPEC='torch==2.13.0+cu128' install
TORCH_SPEC ?= torch==2.13.0
# A folder of local wheels, used when it exists (this machine keeps torch there).
WHEELS ?= /opt/wheels
PIP_FLAGS ?= $(if $(wildcard $(WHEELS)),--find-links $(WHEELS))
# Where the JIT-built extension is cached; `make ext` fills it, tests reuse it.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.torch_extensions
TEST_WORKERS ?= 2
PYTEST_FLAGS ?=

.PHONY: install ext lint docs test demo package package-check bench bench-sweep clean

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(PIP_FLAGS) "$(TORCH_SPEC)"
	$(PY) -m pip install -q $(PIP_FLAGS) -e ".[test,demo,integrations,peers,docs,release]" "$(TORCH_SPEC)"
	touch $@

install: $(VENV)/.installed

ext: install
	$(PY) -c "from ddp_avg_hooks import ops; print('ops backend:', ops.backend())"

lint: install
	$(PY) -m ruff check .

# The user guide and the API reference, into docs/_build/html; any warning (a broken
# reference, a docstring that does not parse) fails the build. -E: a full build every
# time (an incremental one would not see a changed docstring); test reads this build.
docs: install
	$(PY) -m sphinx -W --keep-going -E -q -b html docs docs/_build/html

test: ext lint docs
	DAH_DOCS_BUILT=$(CURDIR)/docs/_build/html $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder $(PYTEST_FLAGS)

demo: ext
	PYTHONPATH=benchmarks$(if $(PYTHONPATH),:$(PYTHONPATH)) $(PY) -m harness.demo

# An sdist and a wheel in dist/, checked by twine; package-check installs the wheel into a
# fresh venv outside the repository (with $(TORCH_SPEC)) and runs the README's example there,
# then examples/local_sgd.py and examples/fsdp2.py (resumed from its round checkpoints).
package: install
	rm -rf dist
	$(PY) -m build --outdir dist .
	$(PY) -m twine check --strict dist/*

package-check: package
	$(PY) tools/package_check.py dist/ddp_avg_hooks-*.whl --torch "$(TORCH_SPEC)" \
	  $(if $(wildcard $(WHEELS)),--find-links $(WHEELS))

# The end-to-end benchmarks (about six hours on 2 cores; needs root for
# the network namespaces, else loopback only). `make bench-sweep`: DiLoCo's tuning sweep.
bench: ext
	$(PY) benchmarks/bench_train.py
	$(PY) benchmarks/bench_train.py --profiles 100mbit --steps 800 --eval-every 40 \
	  --variants ddp,none,torch_localsgd,accelerate_localsgd,allreduce,allreduce_overlap,fp16_overlap,diloco,diloco_fp16,diloco_streaming,torchft_diloco,torchft_streaming_diloco \
	  --out benchmarks/results/overlap_diloco \
	  --title "Overlap (period 8) and DiLoCo (period 32), ~1M-parameter model, 100 Mbit/s, 800-step budget"
	$(PY) benchmarks/bench_train.py --profiles 100mbit --nproc 4 --period 16 \
	  --variants ddp,none,allreduce,hierarchical --out benchmarks/results/hierarchy \
	  --title "Hierarchical averaging, 2 nodes x 2 ranks, 100 Mbit/s between the nodes"
	for seed in 0 1; do \
	  $(PY) benchmarks/bench_train.py --profiles loopback+jitter,loopback+slow-rank --seed $$seed \
	    --variants ddp,allreduce,fp16,allreduce_timed,fp16_timed,allreduce_timed_equal,fp16_timed_overlap,fp16_timed_equal_overlap \
	    --out benchmarks/results/uneven_seed$$seed \
	    --title "Uneven workers (jitter; one rank 1.5x slower by a CPU quota), step-based period 8 vs time-based rounds, seed $$seed"; \
	  $(PY) benchmarks/bench_train.py --profiles loopback+jitter --seed $$seed \
	    --variants ddp,allreduce_overlap,fp16_overlap --out benchmarks/results/uneven_overlap_seed$$seed \
	    --title "Uneven workers, rounds overlapped with training (period 8): jitter, seed $$seed"; \
	  $(PY) benchmarks/bench_train.py --profiles loopback+jitter --seed $$seed --eval-every 0 \
	    --variants ddp,allreduce,fp16,allreduce_overlap,fp16_overlap --out benchmarks/results/jitter_loop_only_seed$$seed \
	    --title "Uneven workers, jitter: the training loop alone (one validation, at the end), period 8, seed $$seed"; \
	  $(PY) benchmarks/bench_train.py --profiles 100mbit --repeats 3 --seed $$seed \
	    --variants ddp,none,ddp_powersgd,torch_localsgd,int8_streaming,int4_streaming,int4_streaming_interleaved,fp16_streaming,torchft_diloco,diloco_int4 \
	    --out benchmarks/results/slow_link_best_seed$$seed \
	    --title "Slow link, best configurations against the peers: 100 Mbit/s, ~1M-parameter model, seed $$seed"; \
	  $(PY) benchmarks/bench_train.py --profiles 100mbit --nproc 4 --repeats 3 --seed $$seed \
	    --baseline hsdp_native --none fsdp_none \
	    --variants hsdp_native,fsdp_none,fsdp_allreduce,fsdp_int8,fsdp_int8_streaming,fsdp_diloco,torchft_fsdp_diloco \
	    --out benchmarks/results/fsdp_replicas_seed$$seed \
	    --title "Sharded replicas (FSDP2): 2 replica groups of 2 ranks, the groups joined at 100 Mbit/s, seed $$seed"; \
	  $(PY) benchmarks/bench_train.py --profiles 100mbit --seed $$seed \
	    --variants ddp,none,ddp_powersgd,torch_localsgd,accelerate_localsgd,allreduce,fp16,int8,int4,fp16_streaming,int8_streaming,int4_streaming,powersgd,powersgd_r32,diloco,diloco_streaming,torchft_diloco,torchft_streaming_diloco \
	    --out benchmarks/results/slow_link_seed$$seed \
	    --title "Slow link, the peers side by side: 100 Mbit/s, ~1M-parameter model, seed $$seed"; \
	  $(PY) benchmarks/bench_train.py --profiles 25mbit --repeats 3 --seed $$seed \
	    --variants ddp,none,ddp_powersgd,torch_localsgd,int8_streaming,int4_streaming,int4_streaming_interleaved,torchft_diloco,diloco_int4 \
	    --out benchmarks/results/slow_link_25mbit_seed$$seed \
	    --title "Slow link at 25 Mbit/s, best configurations against the peers: ~1M-parameter model, seed $$seed"; \
	  for rate in 100 25; do \
	    $(PY) benchmarks/bench_train.py --profiles $${rate}mbit --repeats 3 --seed $$seed \
	      --variants ddp,none,ddp_powersgd,torch_localsgd,torchft_diloco,int4_streaming_interleaved,int2_streaming_interleaved_next_step \
	      --variant-args "int2_streaming_interleaved_next_step=--period 4" \
	      --out benchmarks/results/slow_link_2bit_$${rate}mbit_seed$$seed \
	      --title "Slow link, 2-bit rounds at period 4 against the peers: $$rate Mbit/s, ~1M-parameter model, seed $$seed"; \
	    $(PY) benchmarks/bench_train.py --profiles $${rate}mbit --repeats 3 --seed $$seed \
	      --variants ddp,none,ddp_powersgd,torch_localsgd,torchft_diloco,int4_streaming_interleaved,int2_streaming_interleaved_next_step,int2_streaming_interleaved \
	      --variant-args "int2_streaming_interleaved_next_step=--period 4" \
	      --variant-args "int2_streaming_interleaved=--period 4 --fragments 2 --overlap-steps 1" \
	      --out benchmarks/results/slow_link_low_bits_$${rate}mbit_seed$$seed \
	      --title "Slow link, 4-bit and 2-bit rounds against the peers: $$rate Mbit/s, ~1M-parameter model, seed $$seed"; \
	  done; \
	  $(PY) benchmarks/bench_train.py --profiles 100mbit --repeats 3 --seed $$seed \
	    --variants ddp,none,ddp_powersgd,torch_localsgd,torchft_diloco,int4_streaming_interleaved,int4_streaming_interleaved_next_step,int2_streaming_interleaved \
	    --variant-args "int4_streaming_interleaved_next_step=--fragments 2" \
	    --variant-args "int2_streaming_interleaved=--period 4 --fragments 2 --overlap-steps 1" \
	    --out benchmarks/results/slow_link_two_fragments_100mbit_seed$$seed \
	    --title "Slow link, rounds in 2 fragments, 4-bit at period 8 and 2-bit at period 4, against the peers: 100 Mbit/s, ~1M-parameter model, seed $$seed"; \
	  for rate in 100 25; do \
	    $(PY) benchmarks/bench_train.py --profiles $${rate}mbit --repeats 3 --seed $$seed \
	      --variants ddp,none,ddp_powersgd,torch_localsgd,torchft_diloco,int4_streaming_interleaved,int4_streaming_interleaved_next_step,int2_streaming_interleaved_next_step,int2_streaming_interleaved \
	      --variant-args "int4_streaming_interleaved_next_step=--fragments 2" \
	      --variant-args "int2_streaming_interleaved_next_step=--period 4" \
	      --variant-args "int2_streaming_interleaved=--period 4 --fragments 2 --overlap-steps 1" \
	      --out benchmarks/results/slow_link_background_$${rate}mbit_seed$$seed \
	      --title "Slow link, overlapped rounds coded and sent from the background thread, 4-bit and 2-bit, 4 and 2 fragments, against the peers: $$rate Mbit/s, ~1M-parameter model, seed $$seed"; \
	  done; \
	  $(PY) benchmarks/bench_train.py --profiles 100mbit --repeats 3 --seed $$seed \
	    --variants ddp,none,int4_streaming_interleaved,int4_streaming_interleaved_coded_at_launch,int2_streaming_interleaved,int2_streaming_interleaved_coded_at_launch \
	    --variant-args "int2_streaming_interleaved=--period 4 --fragments 2 --overlap-steps 1" \
	    --variant-args "int2_streaming_interleaved_coded_at_launch=--period 4 --fragments 2 --overlap-steps 1" \
	    --out benchmarks/results/ideas_coding_thread_seed$$seed \
	    --title "Where an overlapped round is coded: the background thread or the training thread at the launch, 4-bit (period 8, 4 fragments) and 2-bit (period 4, 2 fragments), 100 Mbit/s, seed $$seed"; \
	  $(PY) benchmarks/bench_train.py --profiles 100mbit --repeats 3 --seed $$seed \
	    --variants ddp,none,int2_streaming_interleaved_next_step,int2_streaming_interleaved \
	    --variant-args "int2_streaming_interleaved_next_step=--period 4" \
	    --variant-args "int2_streaming_interleaved=--period 4 --fragments 2 --overlap-steps 1" \
	    --out benchmarks/results/ideas_2bit_period4_f2_seed$$seed \
	    --title "Fewer steps and less own work: 2-bit rounds at period 4 in 4 or 2 fragments, applied at the next step, 100 Mbit/s, seed $$seed"; \
	  $(PY) benchmarks/bench_train.py --profiles 100mbit --seed $$seed \
	    --variants ddp,diloco,diloco_int4,diloco_int4_streaming,torchft_diloco,torchft_streaming_diloco \
	    --out benchmarks/results/slow_link_diloco_int4_seed$$seed \
	    --title "Slow link, the DiLoCo family over 4-bit rounds: 100 Mbit/s, ~1M-parameter model, seed $$seed"; \
	done
	$(PY) benchmarks/bench_train.py --profiles 100mbit --repeats 3 --seed 0 \
	  --variants ddp,none,int4_streaming --train-args "--mixing 0.5" \
	  --out benchmarks/results/ideas_mixing \
	  --title "Fewer steps to the target: mixing 0.5 (a late round moves the replicas halfway to the average), 100 Mbit/s, seed 0"
	$(PY) benchmarks/bench_train.py --profiles 100mbit --repeats 3 --seed 0 \
	  --variants ddp,none,int4_streaming --train-args "--fragments 2" \
	  --out benchmarks/results/ideas_fragments2 \
	  --title "Fewer steps to the target: 2 fragments instead of 4, 100 Mbit/s, seed 0"
	$(PY) benchmarks/bench_train.py --profiles 100mbit --repeats 3 --seed 0 \
	  --variants ddp,none,int4_streaming --period 4 \
	  --out benchmarks/results/ideas_period4 \
	  --title "Fewer steps to the target: period 4 instead of 8, 100 Mbit/s, seed 0"
	$(PY) benchmarks/bench_train.py --profiles 100mbit --repeats 3 --seed 0 \
	  --variants ddp,none,int4_streaming --period 4 --variant-args "int4_streaming=--lr 7e-4" \
	  --out benchmarks/results/ideas_period4_lr \
	  --title "Fewer steps to the target: period 4 and the replicas at lr 7e-4 (DDP at 1e-3), 100 Mbit/s, seed 0"
	$(PY) benchmarks/bench_train.py --profiles 100mbit --repeats 3 --seed 0 \
	  --variants ddp,none,int4_streaming --period 4 --variant-args "int4_streaming=--fragments 2" \
	  --out benchmarks/results/ideas_period4_f2 \
	  --title "Fewer steps to the target: period 4 in 2 fragments, 100 Mbit/s, seed 0"
	for seed in 0 1; do \
	  $(PY) benchmarks/bench_train.py --profiles 100mbit --repeats 3 --seed $$seed \
	    --variants ddp,none,int4_streaming --variant-args "int4_streaming=--lr 7e-4" \
	    --out benchmarks/results/ideas_lr_seed$$seed \
	    --title "Fewer steps to the target: the replicas at lr 7e-4 (DDP at 1e-3), 100 Mbit/s, seed $$seed"; \
	  $(PY) benchmarks/bench_train.py --profiles 100mbit --repeats 3 --seed $$seed \
	    --variants ddp,none,int4_streaming --train-args "--lr-warmup 60" \
	    --out benchmarks/results/ideas_warmup60_seed$$seed \
	    --title "Fewer steps to the target: a 60-step learning-rate warm-up for every method, 100 Mbit/s, seed $$seed"; \
	  $(PY) benchmarks/bench_train.py --profiles 100mbit --repeats 3 --seed $$seed \
	    --variants ddp,none,int4_streaming,int4_streaming_interleaved \
	    --out benchmarks/results/ideas_interleaved_seed$$seed \
	    --title "Fewer steps to the target: fragments of layers from all over the model, 100 Mbit/s, seed $$seed"; \
	  $(PY) benchmarks/bench_train.py --profiles 25mbit --repeats 3 --seed $$seed \
	    --variants ddp,none,int4_streaming,int4_streaming_interleaved \
	    --out benchmarks/results/ideas_interleaved_25mbit_seed$$seed \
	    --title "Fewer steps to the target: fragments of layers from all over the model, 25 Mbit/s, seed $$seed"; \
	  $(PY) benchmarks/bench_train.py --profiles 100mbit --repeats 3 --seed $$seed \
	    --variants ddp,none,int4_streaming_interleaved,int4_streaming_interleaved_half_period \
	    --out benchmarks/results/ideas_period4_interleaved_seed$$seed \
	    --title "Fewer steps to the target: period 4 with fragments of layers from all over the model, 100 Mbit/s, seed $$seed"; \
	  $(PY) benchmarks/bench_train.py --profiles 100mbit --repeats 3 --seed $$seed \
	    --variants ddp,none,int4_streaming_interleaved,int4_streaming_interleaved_half_period \
	    --variant-args "int4_streaming_interleaved=--lr 7e-4" \
	    --variant-args "int4_streaming_interleaved_half_period=--lr 7e-4" \
	    --out benchmarks/results/ideas_interleaved_lr_seed$$seed \
	    --title "Fewer steps to the target: fragments of layers from all over the model, the replicas at lr 7e-4 (DDP at 1e-3), period 8 and 4, 100 Mbit/s, seed $$seed"; \
	  $(PY) benchmarks/bench_train.py --profiles 100mbit --repeats 3 --seed $$seed \
	    --variants ddp,none,int4_streaming_interleaved,int4_streaming_interleaved_half_period \
	    --variant-args "int4_streaming_interleaved_half_period=--period 12 --fragments 3" \
	    --out benchmarks/results/ideas_period6_interleaved_seed$$seed \
	    --title "Fewer steps to the target: period 6 in 3 fragments of layers from all over the model, 100 Mbit/s, seed $$seed"; \
	  $(PY) benchmarks/bench_train.py --profiles 100mbit --repeats 3 --seed $$seed \
	    --variants ddp,none,int4_streaming_interleaved,int4_streaming_interleaved_next_step \
	    --out benchmarks/results/ideas_next_step_seed$$seed \
	    --title "Fewer steps to the target: rounds applied at the step after their launch (overlap_steps=1), fragments of layers from all over the model, 100 Mbit/s, seed $$seed"; \
	  $(PY) benchmarks/bench_train.py --profiles 100mbit --repeats 3 --seed $$seed \
	    --variants ddp,none,int4_streaming_interleaved,int4_streaming_interleaved_next_step \
	    --variant-args "int4_streaming_interleaved_next_step=--overlap-steps 2" \
	    --out benchmarks/results/ideas_two_steps_seed$$seed \
	    --title "Fewer steps to the target: rounds applied two steps after their launch (overlap_steps=2), fragments of layers from all over the model, 100 Mbit/s, seed $$seed"; \
	done
	$(PY) benchmarks/bench_train.py --profiles loopback --repeats 3 --seed 0 \
	  --variants ddp,none,torch_localsgd,fp16_streaming,int8_streaming,int4_streaming,int4_streaming_interleaved \
	  --out benchmarks/results/round_wait_loopback \
	  --title "Where the averaging call's time goes: waiting for rounds and the training thread's own work, loopback, seed 0"
	for seed in 0 1; do \
	  $(PY) benchmarks/bench_train.py --profiles loopback --repeats 3 --seed $$seed \
	    --variants ddp,none,int4_streaming,int4_streaming_reducer_on \
	    --out benchmarks/results/reducer_switch_loopback_seed$$seed \
	    --title "The local step with DDP's gradient reducer off after the warm-up, and kept on, loopback, seed $$seed" || exit 1; \
	done
	for seed in 0 1; do \
	  $(PY) benchmarks/bench_train.py --profiles 100mbit --repeats 3 --seed $$seed \
	    --variants ddp,none,int2_streaming_interleaved_next_step,int2_streaming_interleaved \
	    --variant-args "int2_streaming_interleaved_next_step=--period 4" \
	    --variant-args "int2_streaming_interleaved=--period 4 --overlap-steps 2" \
	    --out benchmarks/results/ideas_2bit_two_steps_seed$$seed \
	    --title "Comm wait: 2-bit rounds at period 4 in 4 fragments applied two steps after their launch (overlap_steps=2) against the next step, 100 Mbit/s, seed $$seed" || exit 1; \
	done
	$(PY) benchmarks/bench_local_step.py
	$(PY) benchmarks/bench_local_step.py \
	  --variants none,int4_streaming_interleaved,int4_streaming_interleaved_next_step,int2_streaming_interleaved_next_step,int2_streaming_interleaved \
	  --variant-args "int4_streaming_interleaved_next_step=--fragments 2" \
	  --variant-args "int2_streaming_interleaved_next_step=--period 4" \
	  --variant-args "int2_streaming_interleaved=--period 4 --fragments 2 --overlap-steps 1" \
	  --steps-from "100mbit=results/slow_link_background_100mbit_seed{seed},25mbit=results/slow_link_background_25mbit_seed{seed}" \
	  --title "The local step of the overlapped rounds coded in the background, the variants taking turns in one run" \
	  --out benchmarks/results/local_step_background --runs-dir out/local_step_background
	$(PY) benchmarks/bench_overlap_staleness.py
	$(PY) benchmarks/bench_lr_steps.py --seeds 0,1
	$(PY) benchmarks/bench_optimizer_state_steps.py --seeds 0,1,2,3,4
	$(PY) benchmarks/bench_period_steps.py --seeds 0,1,2,3,4
	$(PY) benchmarks/bench_warmup_steps.py --seeds 0,1,2,3,4
	$(PY) benchmarks/bench_compression_steps.py --seeds 0,1,2,3,4
	$(PY) benchmarks/bench_validation_steps.py --seeds 0,1,2,3,4
	$(PY) benchmarks/bench_fragment_steps.py --seeds 0,1,2,3,4
	$(PY) benchmarks/bench_seed_steps.py
	$(PY) benchmarks/bench_budget_steps.py
	$(PY) benchmarks/bench_check_cost.py

bench-sweep: ext
	$(PY) benchmarks/bench_diloco_sweep.py
	$(PY) benchmarks/bench_diloco_sweep.py --sweep period8

clean:
	rm -rf $(VENV) .torch_extensions build dist docs/_build *.egg-info
