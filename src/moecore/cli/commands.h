// Entry points of the `moecore` subcommands (src/moecore/cli/); apps/main.cpp dispatches `moecore NAME ARGS...` to
// them. Each returns the process exit status and reports errors as one "error: ..." line on stderr.
#pragma once

// `moecore preprocess`: Megatron's tools/preprocess_data.py (JSONL -> indexed dataset). argv[0] is
// "preprocess"; the flags follow.
int run_preprocess(int argc, char** argv);

// `moecore train ...`: argv[0] is "train".
int run_train(int argc, char** argv);

// `moecore generate ...`: argv[0] is "generate".
int run_generate(int argc, char** argv);

// `moecore layout --world-size N ...`: prints the process groups of a parallel layout. argv[0] is "layout".
int run_layout(int argc, char** argv);

// `moecore checkpoint DIR`: prints and verifies a checkpoint. argv[0] is "checkpoint".
int run_checkpoint(int argc, char** argv);

// `moecore quantize --recipe R --format F --as ROLE --input IN --output OUT`: quantizes a safetensors file's fp32
// matrices with an FP8 / MXFP8 / NVFP4 recipe. argv[0] is "quantize".
int run_quantize(int argc, char** argv);

// `moecore plan --num-gpus N [--gpu NAME] <model, batch and layout flags> [--search] [--json]`: memory, FLOPs and
// step-time estimates of a training run. argv[0] is "plan".
int run_plan(int argc, char** argv);

// `moecore report SOURCE... -o REPORT.html`: a run's log, TensorBoard folder and routing traces as one self-contained
// HTML page. argv[0] is "report".
int run_report(int argc, char** argv);
