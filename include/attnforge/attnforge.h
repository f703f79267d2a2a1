// attnforge: attention for LLM inference serving. Include this one header.
#pragma once

#include "attnforge/config.h"
#include "attnforge/context_parallel.h"
#include "attnforge/error.h"
#include "attnforge/kv_cache.h"
#include "attnforge/ops.h"
#include "attnforge/options.h"
#include "attnforge/plan.h"
#include "attnforge/tensor.h"
#include "attnforge/variant.h"
