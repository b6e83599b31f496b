// The header compiles as C++ (strict warnings) and its macros and types work there.
#include <mkernel.h>
#include <cstdio>
#include <cstring>

int main() {
  mkConfig_t config = MK_CONFIG_INITIALIZER;
  static_assert(sizeof(mkUniqueId) == 128, "mkUniqueId is 128 bytes");
  int version = 0;
  if (mkGetVersion(&version) != mkSuccess || version != MK_VERSION_CODE) return 1;
  if (config.size != sizeof(mkConfig_t) || config.magic != MK_CONFIG_MAGIC) return 1;
  if (std::strlen(mkGetErrorString(mkTimeout)) == 0) return 1;
  std::printf("test_cxx: OK (version %d)\n", version);
  return 0;
}
