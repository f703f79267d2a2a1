// Settings from the environment (the ATTNFORGE_* knobs). A value outside the accepted set is an error
// (kInvalidArgument) that names the variable, the value and the set, never a silent default. No fmt here: .cu
// files include it.
#pragma once

#include <initializer_list>
#include <string>

namespace attnforge::detail {

// One of `accepted`; unset or empty: `unset`.
std::string env_choice(const char* name, std::initializer_list<const char*> accepted, const char* unset);
// An integer in [lo, hi]; unset or empty: `unset`.
int env_int(const char* name, int lo, int hi, int unset);

}  // namespace attnforge::detail
