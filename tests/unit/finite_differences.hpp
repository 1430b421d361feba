// Central finite differences for gradient checks, and the comparison that
// reports the worst entry.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

namespace finite_differences {

// d loss / d values[i] ~ (loss(x + eps e_i) - loss(x - eps e_i)) / (2 eps) for
// every i < count: error O(eps^2) from the third derivative plus the rounding
// of loss divided by eps. The step taken is the one the Real type can hold.
template <typename Real, typename Loss>
std::vector<double> central(Real* values, int64_t count, double eps, Loss&& loss) {
  std::vector<double> gradient(count);
  for (int64_t i = 0; i < count; ++i) {
    const Real saved = values[i];
    const Real up = Real(saved + eps), down = Real(saved - eps);
    values[i] = up;
    const double loss_up = loss();
    values[i] = down;
    const double loss_down = loss();
    values[i] = saved;
    gradient[i] = (loss_up - loss_down) / (double(up) - double(down));
  }
  return gradient;
}

// Every analytic[i] within abs_tol + rel_tol * max(|analytic|, |numeric|) of
// numeric[i]; on failure names the worst entry.
template <typename Real>
void require_close(const std::string& what, const Real* analytic,
                   const std::vector<double>& numeric, double abs_tol, double rel_tol) {
  int64_t worst = -1;
  double worst_excess = 0;
  for (int64_t i = 0; i < int64_t(numeric.size()); ++i) {
    const double a = double(analytic[i]), n = numeric[i];
    const double excess =
        std::abs(a - n) - (abs_tol + rel_tol * std::max(std::abs(a), std::abs(n)));
    if (!(excess <= worst_excess)) {  // NaN counts as a failure
      worst = i;
      worst_excess = excess;
    }
  }
  INFO(what << ": entry " << worst << " analytic " << (worst >= 0 ? double(analytic[worst]) : 0.0)
            << " numeric " << (worst >= 0 ? numeric[worst] : 0.0));
  REQUIRE(worst == -1);
}

}  // namespace finite_differences
