// The status macros forward the first error unchanged and run nothing after it.
#include "spin/status_macros.h"

#include <memory>
#include <string>

#include "gtest/gtest.h"

namespace spin {
namespace {

absl::StatusOr<int> Half(int x) {
  if (x % 2 != 0) return absl::InvalidArgumentError("odd: " + std::to_string(x));
  return x / 2;
}

absl::Status Check(int x) {
  if (x < 0) return absl::OutOfRangeError("negative");
  return absl::OkStatus();
}

absl::StatusOr<int> Quarter(int x, int* steps) {
  SPIN_RETURN_IF_ERROR(Check(x));
  ++*steps;
  SPIN_ASSIGN_OR_RETURN(int h, Half(x));
  ++*steps;
  SPIN_ASSIGN_OR_RETURN(h, Half(h));  // assigns to an existing variable
  ++*steps;
  return h;
}

TEST(StatusMacros, ValuesPassThrough) {
  int steps = 0;
  absl::StatusOr<int> q = Quarter(12, &steps);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(*q, 3);
  EXPECT_EQ(steps, 3);
}

TEST(StatusMacros, TheFirstErrorReturnsUnchangedAndStopsTheRest) {
  int steps = 0;
  absl::StatusOr<int> q = Quarter(-4, &steps);
  EXPECT_EQ(q.status(), absl::OutOfRangeError("negative"));
  EXPECT_EQ(steps, 0);

  steps = 0;
  q = Quarter(7, &steps);
  EXPECT_EQ(q.status(), absl::InvalidArgumentError("odd: 7"));
  EXPECT_EQ(steps, 1);

  steps = 0;
  q = Quarter(6, &steps);  // 6 / 2 = 3 is odd
  EXPECT_EQ(q.status(), absl::InvalidArgumentError("odd: 3"));
  EXPECT_EQ(steps, 2);
}

absl::Status UseTwice(bool fail_second) {
  // Two ASSIGN_OR_RETURNs in one scope (distinct temporaries), and move-only values.
  SPIN_ASSIGN_OR_RETURN(std::unique_ptr<int> a,
                        absl::StatusOr<std::unique_ptr<int>>(std::make_unique<int>(1)));
  SPIN_ASSIGN_OR_RETURN(std::unique_ptr<int> b,
                        fail_second
                            ? absl::StatusOr<std::unique_ptr<int>>(absl::NotFoundError("second"))
                            : absl::StatusOr<std::unique_ptr<int>>(std::make_unique<int>(2)));
  return *a + *b == 3 ? absl::OkStatus() : absl::InternalError("sum");
}

TEST(StatusMacros, MoveOnlyValuesAndRepeatedUse) {
  EXPECT_TRUE(UseTwice(false).ok());
  EXPECT_EQ(UseTwice(true), absl::NotFoundError("second"));
}

}  // namespace
}  // namespace spin
