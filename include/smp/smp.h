// smp C++ API umbrella header. See docs/cpp_api.md.
#pragma once
