// write_torch_save: files that PyTorch's own torch.load reads back (Debian's python3-torch through /usr/bin/python3)
// with every value kind, tensor shapes and values bit for bit.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <string>

#include "moecore/util/torch_save.h"
#include "test_temp_dir.h"

namespace moecore {
namespace {

// stdout of `command`.
std::string run(const std::string& command) {
  std::unique_ptr<FILE, int (*)(FILE*)> pipe(popen(command.c_str(), "r"), pclose);
  std::string out;
  std::array<char, 4096> buffer{};
  while (pipe && fgets(buffer.data(), buffer.size(), pipe.get()) != nullptr) out += buffer.data();
  return out;
}

TEST(TorchSave, TorchLoadReadsEveryKind) {
  const test::TempDir dir("torch_save");
  const std::string path = dir.path("state_rank0.pt");
  std::vector<float> weight(3 * 4);
  for (size_t i = 0; i < weight.size(); ++i) weight[i] = std::ldexp(static_cast<float>(i) - 5.5f, -3);
  weight[7] = std::numeric_limits<float>::denorm_min();
  write_torch_save(
      path,
      PyValue::dict({{PyValue::tuple({PyValue::string("decoder"), PyValue::none(), PyValue::integer(3)}),
                      PyValue::dict({{PyValue::string("weight"), PyValue::float_tensor({3, 4}, weight)},
                                     {PyValue::string("expert_bias"), PyValue::float_tensor({3}, {0.5f, -1.0f, 2.0f})},
                                     {PyValue::string("none"), PyValue::none()},
                                     {PyValue::string("score_function"), PyValue::string("sigmoid")},
                                     {PyValue::string("topk"), PyValue::integer(2)},
                                     {PyValue::string("big"), PyValue::integer(-5000000000)},
                                     {PyValue::string("mid"), PyValue::integer(70000)},
                                     {PyValue::string("flag"), PyValue::boolean(true)}})},
                     {PyValue::string("empty"), PyValue::dict({})}}));
  const std::string script =
      "import torch, sys\n"
      "d = torch.load(sys.argv[1])\n"
      "s = d[('decoder', None, 3)]\n"
      "w = s['weight']\n"
      "print(w.dtype, tuple(w.shape), w.stride(), w.flatten().tolist() == [x / 8 - 5.5 / 8 for x in range(12)][:7] + "
      "[w.flatten()[7].item()] + [x / 8 - 5.5 / 8 for x in range(12)][8:], w.flatten()[7].item() == 2.0 ** -149)\n"
      "print(s['expert_bias'].tolist(), s['none'], s['score_function'], s['topk'], s['big'], s['mid'], s['flag'], "
      "d['empty'])\n";
  const std::string out = run("/usr/bin/python3 -c \"" + std::string(script) + "\" " + path + " 2>&1");
  EXPECT_EQ(out,
            "torch.float32 (3, 4) (4, 1) True True\n"
            "[0.5, -1.0, 2.0] None sigmoid 2 -5000000000 70000 True {}\n");
}

TEST(TorchSave, RefusesAShapeThatDoesNotMatch) {
  EXPECT_THROW(PyValue::float_tensor({2, 3}, {1.0f}), std::invalid_argument);
}

}  // namespace
}  // namespace moecore
