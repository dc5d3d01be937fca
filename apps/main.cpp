// `moecore`: one command with subcommands, like git.
#include <cstring>
#include <iostream>
#include <string_view>

#include "moecore/cli/commands.h"

namespace {

void print_usage(std::ostream& out) {
  out << "usage: moecore <command> [flags]\n\n"
         "commands:\n"
         "  train        train a GPT model (Megatron-LM's flags; `moecore train --help` lists them)\n"
         "  preprocess   tokenize JSONL into Megatron's indexed dataset (tools/preprocess_data.py's flags)\n"
         "  generate     continue a prompt with a HuggingFace-style export (--load DIR --prompt TEXT)\n"
         "  layout       print the process groups of a parallel layout (--world-size N, TP/PP/CP/EP/ETP flags)\n"
         "  checkpoint   print a checkpoint's iteration, layout and tensors and verify every checksum (DIR)\n"
         "  quantize     quantize a safetensors file's fp32 matrices with an FP8 / MXFP8 / NVFP4 recipe (--recipe "
         "...)\n"
         "  plan         memory, FLOPs and step time of a training run on a GPU cluster; --search ranks layouts\n"
         "  report       one HTML page of a run's curves, expert load and alarms (log, TensorBoard, routing traces)\n";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    print_usage(std::cerr);
    return 2;
  }
  const std::string_view command = argv[1];
  if (command == "-h" || command == "--help" || command == "help") {
    print_usage(std::cout);
    return 0;
  }
  if (command == "train") return run_train(argc - 1, argv + 1);
  if (command == "preprocess") return run_preprocess(argc - 1, argv + 1);
  if (command == "generate") return run_generate(argc - 1, argv + 1);
  if (command == "layout") return run_layout(argc - 1, argv + 1);
  if (command == "checkpoint") return run_checkpoint(argc - 1, argv + 1);
  if (command == "quantize") return run_quantize(argc - 1, argv + 1);
  if (command == "plan") return run_plan(argc - 1, argv + 1);
  if (command == "report") return run_report(argc - 1, argv + 1);
  std::cerr << "error: unknown command '" << command
            << "' (commands: train, preprocess, generate, layout, checkpoint, quantize, plan, report)\n";
  return 2;
}
