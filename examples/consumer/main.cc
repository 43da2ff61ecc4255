// The smallest program on the installed zinf: fit y = 3x - 1 with ZeRO-3 on two local ranks.
#include <cmath>
#include <cstdio>
#include <thread>

#include "zinf/comm/local.h"
#include "zinf/engine/engine.h"

int main() {
  using namespace zinf;
  auto group = comm::make_local_group(2);
  if (!group.is_ok()) return 1;
  std::vector<zero::UnitSpec> units = {
      {.name = "line", .params = {{.name = "w", .shape = {1}}, {.name = "b", .shape = {1}}}}};
  EngineSettings settings;
  settings.stage = 3;
  settings.adam.lr = 0.05f;
  std::vector<float> final_params(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      auto engine = Engine::create(settings, *(*group)[r], units, [](size_t, uint64_t, uint64_t) {
                      return 0.0f;
                    }).value();
      for (int step = 0; step < 300; ++step) {
        auto scope = engine->gather(0).value();
        // Device memory is reached through the device: a host copy in, gradients out.
        float p[2], g[2] = {0, 0};
        if (!scope.params_to_host(p).is_ok()) return;
        for (int i = 0; i < 4; ++i) {  // each rank its own samples
          float x = static_cast<float>(r * 4 + i) / 8.0f, y = 3 * x - 1;
          float err = p[0] * x + p[1] - y;
          g[0] += err * x / 4;
          g[1] += err / 4;
        }
        if (!scope.grads_from_host(g).is_ok()) return;
        if (!scope.finish().is_ok() || !engine->step().is_ok()) return;
      }
      auto full = engine->full_parameters(0);
      if (r == 0 && full.is_ok()) final_params = *full;
    });
  }
  for (auto& t : ranks) t.join();
  std::printf("w = %.3f, b = %.3f (expected 3, -1)\n", final_params[0], final_params[1]);
  return std::fabs(final_params[0] - 3) < 0.1 && std::fabs(final_params[1] + 1) < 0.1 ? 0 : 1;
}
