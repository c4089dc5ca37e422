/* The header twice in one C11 translation unit: its include guard must make
 * the second inclusion a no-op (no redefinition errors under -Werror). */
#include <orbite/nixl.h>
#include <orbite/nixl.h>

#include <stdio.h>

#ifndef ORBITE_NIXL_H
#error "include guard ORBITE_NIXL_H is not defined"
#endif

int main(void) {
    OrbiteAbiInfo info = { .size = sizeof(OrbiteAbiInfo), .version = ORBITE_RECORD_VERSION };
    OrbiteStatus s = orbite_abi_info(&info);
    if (s != ORBITE_STATUS_OK || info.abi_major != ORBITE_ABI_MAJOR) {
        fprintf(stderr, "orbite_abi_info: status %d, abi_major %u\n", (int)s, info.abi_major);
        return 1;
    }
    printf("include_twice: ok\n");
    return 0;
}
