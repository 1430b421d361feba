// Central finite differences for gradient checks, and the comparison that
// reports the worst entry.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
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

// The entries of a parameter of `numel` that a gradient check compares:
// all of them, or with MESHRUN_GRADIENT_CHECK_ENTRIES = n (the quick tier,
// where the sanitized reference takes minutes otherwise) n spread evenly
// over it, the first and the last among them. A missing or wrong term of
// the backward moves nearly every entry, so a sample catches it; the full
// sweep compares every entry.
inline std::vector<int64_t> checked_entries(int64_t numel) {
  const char* limit = std::getenv("MESHRUN_GRADIENT_CHECK_ENTRIES");
  const int64_t n = limit != nullptr ? std::max<int64_t>(2, std::atoll(limit)) : numel;
  std::vector<int64_t> entries;
  for (int64_t k = 0; k < std::min(n, numel); ++k) {
    entries.push_back(numel <= n ? k : k * (numel - 1) / (n - 1));
  }
  return entries;
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
